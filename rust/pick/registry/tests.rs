use super::*;
use crate::endpoint::Saturation;
use crate::pick::Pipeline;

/// The plugin table of docs/picker.md: (name, kind) per row.
fn documented() -> Vec<(String, String)> {
    let doc = include_str!("../../../docs/picker.md");
    doc.lines()
        .skip_while(|l| !l.starts_with("| plugin | kind |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_owned(), cells[2].to_owned())
        })
        .collect()
}

#[test]
fn the_docs_table_lists_the_registry() {
    let registry: Vec<(String, String)> = REGISTRY
        .iter()
        .map(|d| (d.name.to_owned(), d.kind.words().to_owned()))
        .collect();
    assert_eq!(documented(), registry);
}

#[test]
fn every_plugin_builds_without_parameters_into_its_kind_and_refuses_unknown_ones() {
    let mut names: Vec<&str> = REGISTRY.iter().map(|d| d.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), REGISTRY.len(), "names are unique");
    for d in REGISTRY {
        let (kind, built) = build(0, &PluginSpec::new(d.name, 1.0), &PickConfig::default())
            .unwrap_or_else(|e| panic!("{}: {e}", d.name));
        assert_eq!(kind, d.kind);
        let matches = match built {
            Built::Filter(_) => matches!(kind, Kind::Filter { .. }),
            Built::Scorer(_) => kind == Kind::Scorer,
            Built::Picker(_) => kind == Kind::Picker,
        };
        assert!(matches, "{} builds a {:?}", d.name, kind);
        let spec = PluginSpec::with(d.name, 1.0, serde_json::json!({"nope": 1}));
        let err = build(3, &spec, &PickConfig::default()).expect_err("unknown parameter");
        assert!(
            err.to_string()
                .starts_with(&format!("plugins[3] {:?}: nope: unknown parameter", d.name)),
            "{err}"
        );
        let spec = PluginSpec::with(d.name, 1.0, serde_json::json!([1]));
        assert!(
            build(0, &spec, &PickConfig::default()).is_err(),
            "not an object"
        );
    }
}

#[test]
fn an_unknown_name_lists_every_known_one_by_kind() {
    let err = describe("herd").err().expect("unknown").to_string();
    assert!(
        err.starts_with("unknown plugin \"herd\" (filters: healthy, "),
        "{err}"
    );
    for d in REGISTRY {
        assert!(err.contains(d.name), "{err} lacks {}", d.name);
    }
    let err = Pipeline::from_specs(
        &[PluginSpec::new("herd", 1.0)],
        &["a"],
        &PickConfig::default(),
    )
    .expect_err("unknown");
    assert!(
        err.to_string().starts_with("unknown plugin \"herd\""),
        "{err}"
    );
}

#[test]
fn a_bad_value_names_its_key_and_a_null_is_the_default() {
    let spec = PluginSpec::with("prefix", 1.0, serde_json::json!({"block_size": "16"}));
    let err = build(1, &spec, &PickConfig::default()).expect_err("a string");
    assert!(
        err.to_string()
            .starts_with("plugins[1] \"prefix\": block_size: invalid type"),
        "{err}"
    );
    let spec = PluginSpec::with("vtc", 1.0, serde_json::json!({"window_s": null}));
    assert!(build(0, &spec, &PickConfig::default()).is_ok());
}

#[test]
fn the_data_plane_settings_reach_the_plugins_that_take_them() {
    let shared = Shared {
        prefix_block_size: 64,
        saturation: Saturation {
            max_waiting: 9.0,
            max_kv_usage: 0.5,
        },
    };
    for preset in crate::pick::PRESETS {
        let mut specs = crate::pick::preset_specs(preset).expect("preset");
        let before = specs.clone();
        apply_shared(&mut specs, &shared);
        for (b, a) in before.iter().zip(&specs) {
            let want = match b.name.as_str() {
                "prefix" | "precise-prefix" => serde_json::json!({"block_size": 64}),
                "saturation" => serde_json::json!({"max_waiting": 9.0, "max_kv_usage": 0.5}),
                _ => b.params.clone(),
            };
            assert_eq!(a.params, want, "{preset}: {}", b.name);
        }
        Pipeline::from_specs(&specs, &["a", "b"], &PickConfig::default()).expect("builds");
    }
}

#[test]
fn needs_say_which_plugins_read_the_kv_index_and_token_ids() {
    let of = |preset: &str| needs(&crate::pick::preset_specs(preset).expect("preset"));
    for preset in crate::pick::PRESETS {
        let precise = preset.starts_with("precise-prefix");
        assert_eq!(of(preset).kv_index, precise, "{preset}");
        assert_eq!(of(preset).token_ids, precise, "{preset}");
        assert_eq!(of(preset).hashes, preset.contains("prefix"), "{preset}");
        assert!(
            of(preset).scraped,
            "{preset}: every preset filters on health"
        );
    }
    assert_eq!(needs(&[PluginSpec::new("random", 1.0)]), Needs::NOTHING);
}

#[test]
fn a_seed_taken_from_the_config_is_written_into_the_spec() {
    let config = PickConfig {
        seed: 5,
        ..PickConfig::default()
    };
    let random = resolved(&PluginSpec::new("random", 1.0), &config);
    assert_eq!(random.params, serde_json::json!({"seed": 5}));
    let first = PluginSpec::with("max-score", 1.0, serde_json::json!({"ties": "first"}));
    assert_eq!(resolved(&first, &config), first);
    let plain = PluginSpec::new("max-score", 1.0);
    assert_eq!(resolved(&plain, &config), plain, "null stays null");
    let given = PluginSpec::with("random", 1.0, serde_json::json!({"seed": 2}));
    assert_eq!(resolved(&given, &config), given);
}
