//! The request pipeline: an OpenAI body parsed, routed and, when the router
//! says "compress", compressed, in one call ([`route_request`]). It joins
//! [`crate::openai`] (what the body says), [`crate::budget`] (which pool) and
//! [`crate::compress`] (compress-and-route, FleetOpt section 5); each of those
//! knows nothing of the others' steps.

use crate::budget::{compressible_category, Decision, TokenBudgetRouter};
use crate::compress::{Compressor, RequestCompression};
use crate::error::Result;
use crate::openai::{parse_request, MediaTokens, ParsedRequest};

/// A request routed by [`route_request`]: what was read from the body, the
/// decision, the body to send and, when compression was tried, its outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutedRequest {
    pub request: ParsedRequest,
    pub decision: Decision,
    pub body: Vec<u8>,
    pub compression: Option<RequestCompression>,
}

/// Parses an OpenAI body, routes it and carries out compress-and-route in one
/// call. The estimate is the calibrator's for every text the engine
/// tokenizes plus the request's media tokens (see [`crate::openai`]); the
/// compress band is judged on that whole estimate. When the router says
/// "compress", the message prose is compressed so the texts estimate within
/// the decision's target less the media tokens, with the calibrator's
/// conservative ratio for the request's category (the ratio the estimate
/// used); tool schemas, tool calls and media are never rewritten. If that
/// succeeds the request is counted on the smaller pool and the new body
/// returned, else it is routed as it is (the compression outcome still
/// reported, its token counts including the media tokens), so a request is
/// never sent to a pool it does not fit.
pub fn route_request(
    router: &TokenBudgetRouter,
    compressor: &Compressor,
    body: &[u8],
    default_max_tokens: u64,
    media: MediaTokens,
) -> Result<RoutedRequest> {
    let request = parse_request(body, default_max_tokens, media)?;
    let out = request.max_output_tokens;
    let media = request.media_tokens;
    let routed = |decision, body: &[u8], compression| RoutedRequest {
        request: request.clone(),
        decision,
        body: body.to_vec(),
        compression,
    };
    if let Some(tokens) = request.prompt_tokens {
        return Ok(routed(router.route_estimated(tokens, out), body, None));
    }
    let (est, ratio, compressible) = {
        let cal = router.read_calibrator();
        let id = cal.id(request.category);
        (
            cal.estimate_tokens_id(request.prompt_bytes, id) + media,
            cal.conservative_ratio_id(id),
            compressible_category(request.category),
        )
    };
    let total = est.saturating_add(out);
    let target = router
        .compress_target(total, out)
        .filter(|&(_, target)| compressible && target > media);
    let Some((pool, target)) = target else {
        return Ok(routed(router.route_estimated(est, out), body, None));
    };
    let mut c = compressor.compress_request(
        body,
        (target - media) as i64,
        Some(request.category),
        Some(ratio),
    )?;
    c.summary.tokens_before += media;
    c.summary.tokens_after += media;
    if c.summary.status.succeeded() {
        let decision = router.route_compressed(pool, est, out, target);
        let new_body = c.body.clone();
        return Ok(routed(decision, &new_body, Some(c)));
    }
    Ok(routed(router.route_estimated(est, out), body, Some(c)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibrate::estimate;
    use crate::compress::tests::prose;
    use serde_json::Value;

    /// Pools of 1,000 and 8,000 tokens, a band of 1.5, 4 bytes per token.
    fn band_router() -> TokenBudgetRouter {
        use crate::budget::Pool;
        use crate::calibrate::Calibrator;
        use std::sync::{Arc, RwLock};
        let pools = vec![
            Pool::new("short", 1000, None, None).expect("pool"),
            Pool::new("long", 8000, None, None).expect("pool"),
        ];
        let cal = Calibrator::new(0.95, 1.0, 4.0, 8).expect("cal");
        TokenBudgetRouter::new(pools, Arc::new(RwLock::new(cal)))
            .expect("router")
            .with_compress_band(1.5)
            .expect("band")
    }

    #[test]
    fn route_request_compresses_prose_around_tools_and_media_to_fit() {
        use crate::budget::Action;
        let router = band_router();
        let tools = serde_json::json!([{"type": "function", "function": {
            "name": "lookup", "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": "x".repeat(400)}}}}}]);
        let body = serde_json::json!({
            "messages": [
                {"role": "user", "content": prose(45)},
                {"role": "user", "content": [
                    {"type": "text", "text": "Summarise."},
                    {"type": "image_url", "image_url": {"url": "x"}}]}],
            "tools": tools,
            "max_tokens": 100});
        let bytes = serde_json::to_vec(&body).expect("json");
        let media = MediaTokens::new(200, 0).expect("valid");
        let before = parse_request(&bytes, 16, media).expect("parses");
        let total = estimate(before.prompt_bytes, 4.0) + 200 + 100;
        assert!(total > 1000 && total <= 1500, "{total}");
        let r = route_request(&router, &Compressor::default(), &bytes, 16, media).expect("valid");
        assert_eq!(
            (r.decision.action, r.decision.pool),
            (Action::Compress, Some(0))
        );
        let after = parse_request(&r.body, 16, media).expect("parses");
        assert!(estimate(after.prompt_bytes, 4.0) + after.media_tokens + 100 <= 1000);
        let v: Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(v["tools"], tools);
        let comp = r.compression.expect("tried");
        assert_eq!(comp.summary.tokens_before, total - 100);
        assert!(comp.summary.tokens_after <= 900);
    }

    #[test]
    fn route_request_compresses_borderline_prose_only() {
        use crate::budget::Action;
        let router = band_router();
        let c = Compressor::default();
        // About 1,040 prompt tokens + 100 out: in (1000, 1500].
        let body = serde_json::json!({"prompt": prose(68), "max_tokens": 100});
        let bytes = serde_json::to_vec(&body).expect("json");
        let r = route_request(&router, &c, &bytes, 16, MediaTokens::default()).expect("valid");
        assert_eq!(r.decision.action, Action::Compress);
        assert_eq!(r.decision.pool, Some(0));
        let comp = r.compression.expect("tried");
        assert!(comp.summary.tokens_after <= 900);
        let parsed = parse_request(&r.body, 16, MediaTokens::default()).expect("parses");
        assert!(estimate(parsed.prompt_bytes, 4.0) + 100 <= 1000);
        // The same body with code is routed long, untouched.
        let code = "fn f(x: u32) -> u32 {\n    x + 1;\n}\n".repeat(120);
        let body = serde_json::json!({"prompt": code, "max_tokens": 100});
        let bytes = serde_json::to_vec(&body).expect("json");
        let r = route_request(&router, &c, &bytes, 16, MediaTokens::default()).expect("valid");
        assert_eq!(
            (r.decision.pool, r.decision.action),
            (Some(1), Action::Route)
        );
        assert_eq!((r.body, r.compression), (bytes, None));
        assert_eq!(router.in_flight(0), Ok(1));
        assert!(route_request(&router, &c, b"[]", 16, MediaTokens::default()).is_err());
        assert_eq!(router.in_flight(1), Ok(1));
    }
}
