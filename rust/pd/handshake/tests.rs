use super::*;
use serde_json::json;

const MAX: usize = 1 << 20;

fn parse(b: &[u8]) -> Value {
    serde_json::from_slice(b).expect("JSON")
}

fn chat(extra: Value) -> Vec<u8> {
    let mut m = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
    });
    for (k, v) in extra.as_object().expect("object") {
        m[k] = v.clone();
    }
    serde_json::to_vec(&m).expect("JSON")
}

#[test]
fn the_vllm_prefill_asks_one_token_unstreamed_for_a_remote_decode() {
    let body = chat(json!({
        "max_tokens": 64, "max_completion_tokens": 64, "stream": true,
        "stream_options": {"include_usage": true},
        "kv_transfer_params": {"remote_host": "evil"},
    }));
    let p = parse(&vllm_prefill(&body, MAX).expect("prefill"));
    assert_eq!(p["max_tokens"], 1);
    assert_eq!(p["max_completion_tokens"], 1);
    assert_eq!(p["stream"], false);
    assert!(p.get("stream_options").is_none());
    assert_eq!(
        p["kv_transfer_params"],
        remote_decode(),
        "the client's is replaced"
    );
    assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
    // Everything else is the client's.
    let mut back = p.as_object().expect("object").clone();
    let client = parse(&body);
    for k in ["messages", "model", "temperature"] {
        assert_eq!(back.remove(k), client.get(k).cloned(), "{k}");
    }
}

#[test]
fn a_body_without_max_tokens_gets_one_and_no_max_completion_tokens() {
    let p = parse(&vllm_prefill(&chat(json!({})), MAX).expect("prefill"));
    assert_eq!(p["max_tokens"], 1);
    assert!(p.get("max_completion_tokens").is_none());
    assert_eq!(p["stream"], false);
}

#[test]
fn the_vllm_decode_is_the_clients_body_with_the_prefills_params() {
    let body = chat(json!({"max_tokens": 12, "stream": true,
                           "kv_transfer_params": {"remote_host": "evil"}}));
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "e1",
                        "remote_block_ids": [1, 2, 3], "remote_host": "10.0.0.2",
                        "remote_port": 5600});
    let answer =
        serde_json::to_vec(&json!({"choices": [], "kv_transfer_params": params})).expect("JSON");
    let d = parse(&vllm_decode(&body, &answer, MAX, true).expect("decode"));
    let mut want = parse(&body);
    want["kv_transfer_params"] = params;
    assert_eq!(
        d, want,
        "round trip: the client's body, the params replaced"
    );
}

#[test]
fn a_prefill_answer_without_params_is_no_params_unless_they_are_optional() {
    let body = chat(json!({"max_tokens": 12, "kv_transfer_params": {"x": 1}}));
    for answer in [
        json!({"choices": []}),
        json!({"kv_transfer_params": null}),
        json!({"kv_transfer_params": [1]}),
    ] {
        let a = serde_json::to_vec(&answer).expect("JSON");
        let e = vllm_decode(&body, &a, MAX, true).expect_err("no params");
        assert_eq!(e, Fallback::NoParams);
        assert!(e.to_string().contains("kv_transfer_params"), "{e}");
        let d = parse(&vllm_decode(&body, &a, MAX, false).expect("optional"));
        let mut want = parse(&body);
        want.as_object_mut()
            .expect("object")
            .remove("kv_transfer_params");
        assert_eq!(d, want, "the client's own params never pass");
    }
}

#[test]
fn huge_or_malformed_json_is_refused() {
    let body = chat(json!({}));
    for bad in [&b"{\"a\": "[..], b"[1, 2]", b"", b"null", &[0xff, 0xfe][..]] {
        assert!(vllm_prefill(bad, MAX).is_err(), "{bad:?}");
        assert!(
            sglang(bad, MAX, "10.0.0.1:8000", None, 1).is_err(),
            "{bad:?}"
        );
        assert_eq!(vllm_decode(&body, bad, MAX, true), Err(Fallback::BadAnswer));
        assert_eq!(
            vllm_decode(bad, b"{}", MAX, false),
            Err(Fallback::BadAnswer)
        );
    }
    let e = vllm_prefill(&body, body.len() - 1).expect_err("over the bound");
    assert!(e.to_string().contains("over the bound"), "{e}");
    let huge = format!(
        "{{\"kv_transfer_params\": {{}}, \"pad\": \"{}\"}}",
        "x".repeat(MAX)
    );
    assert_eq!(
        vllm_decode(&body, huge.as_bytes(), MAX, true),
        Err(Fallback::BadAnswer)
    );
    // Nesting past serde_json's recursion limit is refused, not a stack overflow.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(vllm_prefill(deep.as_bytes(), MAX).is_err());
}

#[test]
fn sglang_sends_the_same_body_with_the_prefills_bootstrap_and_one_room() {
    let body = chat(
        json!({"max_tokens": 12, "stream": true, "bootstrap_room": 7,
                           "bootstrap_host": "evil"}),
    );
    let out = sglang(&body, MAX, "10.0.0.3:30000", Some(8998), 42).expect("sglang");
    let s = parse(&out);
    assert_eq!(s["bootstrap_host"], "10.0.0.3");
    assert_eq!(s["bootstrap_port"], 8998);
    assert_eq!(s["bootstrap_room"], 42);
    let mut back = s.as_object().expect("object").clone();
    for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        back.remove(k);
    }
    let mut want = parse(&body);
    for k in ["bootstrap_host", "bootstrap_room"] {
        want.as_object_mut().expect("object").remove(k);
    }
    assert_eq!(
        Value::Object(back),
        want,
        "round trip: otherwise the client's body"
    );
    let s = parse(&sglang(&body, MAX, "[::1]:30000", None, MAX_ROOM).expect("v6"));
    assert_eq!(
        (s["bootstrap_host"].clone(), s["bootstrap_port"].clone()),
        (json!("::1"), Value::Null)
    );
    assert_eq!(s["bootstrap_room"], MAX_ROOM);
    assert!(sglang(&body, MAX, "h:1", None, MAX_ROOM + 1).is_err());
}

#[test]
fn hosts_of_endpoints() {
    for (e, h) in [
        ("10.0.0.1:8000", "10.0.0.1"),
        ("engine-0.svc:80", "engine-0.svc"),
        ("[fe80::1]:9", "fe80::1"),
        ("plainhost", "plainhost"),
        ("::1", "::1"),
    ] {
        assert_eq!(host(e), h, "{e}");
    }
}

#[test]
fn names_are_the_configs_and_the_metrics() {
    assert_eq!(
        HANDOFFS.map(|n| serde_json::from_value::<Handoff>(json!(n))
            .expect(n)
            .as_str()),
        HANDOFFS
    );
    assert!(serde_json::from_value::<Handoff>(json!("nixl")).is_err());
    let all = [
        Fallback::Connect,
        Fallback::Status,
        Fallback::Timeout,
        Fallback::BadAnswer,
        Fallback::NoParams,
    ];
    assert_eq!(all.map(Fallback::as_str), FALLBACKS);
    assert!(!Handoff::Header.sends() && Handoff::Vllm.sends() && Handoff::Sglang.sends());
}
