"""Profile: the papers' worked KV and slot numbers, TOML loading, errors."""

import pickle

import pytest

from routecore import Profile, Workload, load_profile


def test_llama3_70b_a100_matches_fleetopt():
    p = Profile.llama3_70b_a100()
    # 2 * 80 layers * 8 KV heads * 128 * 2 bytes = 320 KiB/token (FleetOpt 2.2)
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert p.kv_bytes_per_token_per_gpu == 320 * 1024 / 8
    # n_max: 16 at 64K, 128 at 8K, 256 at 4K, 682 at 1.5K (FleetOpt 7.1)
    assert [p.slots(c) for c in (65536, 8192, 4096, 1536)] == [16, 128, 256, 682]
    assert p.t_iter(16) == pytest.approx(0.0184)  # token-budget paper App. A
    assert p.t_iter(128) == pytest.approx(0.0912)


def test_qwen3_235b_mi300x_matches_the_case_study():
    p = Profile.qwen3_235b_mi300x()
    # 4 KV heads over TP=8: one head per GPU, 2 * 94 * 1 * 128 * 1 B = 23.5 KiB
    assert p.kv_bytes_per_token_per_gpu == 23.5 * 1024
    # 192 GB * 0.9 - 29.4 - 10 = 133.4 GB of KV; 676 slots at 8K, 169 at 32K
    assert p.gpu_memory_bytes * p.utilization - p.model_memory_bytes == pytest.approx(133.4e9)
    assert p.slots(8192) == 676
    assert p.slots(32768) == 169


def test_custom_profile_and_by_hand_service():
    p = Profile(
        "toy",
        layers=2,
        kv_heads=2,
        head_dim=4,
        dtype_bytes=2,
        gpu_memory_bytes=1e6,
        model_memory_bytes=0,
        utilization=1.0,
        w_s=0.01,
        h_s=0.001,
        c_chunk=100,
    )
    assert p.kv_bytes_per_token == 64
    assert p.slots(1000) == 15  # floor(1e6 / 64000)
    w = Workload([250, 50], [10, 20])
    s = p.service(w, 1000)
    t = 0.01 + 0.001 * 15
    # k = ceil(250/100) + 10 = 13 and ceil(50/100) + 20 = 21
    assert s.mean_s == pytest.approx(17 * t)
    assert s.cs2 == pytest.approx(16 / 17**2)
    assert s.mu_gpu == pytest.approx(15 / (17 * t))


def test_bad_profiles_raise():
    base = Profile.llama3_70b_a100()
    for change in [
        {"layers": 0},
        {"utilization": 0.0},
        {"utilization": 1.2},
        {"model_memory_bytes": 1e15},
        {"w_s": float("nan")},
        {"c_chunk": 0},
        {"price_per_gpu_hour": -1.0},
        {"h_ref_tokens": 0},
        {"no_such_field": 1},
    ]:
        with pytest.raises(ValueError):
            base.replace(**change)
    with pytest.raises(ValueError):
        base.slots(0)
    with pytest.raises(ValueError):
        base.service(Workload([1], [1]), 1024, prefill_quantile=2.0)


def test_pickle_and_replace():
    p = Profile.qwen3_235b_mi300x().replace(h_ref_tokens=8192)
    assert pickle.loads(pickle.dumps(p)) == p
    assert p.replace(h_ref_tokens=None) == Profile.qwen3_235b_mi300x()


def test_load_profile_toml(tmp_path):
    f = tmp_path / "h100.toml"
    f.write_text('name = "llama3-70b-h100"\npreset = "llama3_70b_a100"\nw_s = 0.004\n')
    p = load_profile(f)
    assert p.name == "llama3-70b-h100"
    assert p.w_s == 0.004
    assert p.slots(65536) == 16
    full = tmp_path / "full.toml"
    full.write_text(
        'name = "x"\nlayers = 32\nkv_heads = 8\nhead_dim = 128\ndtype_bytes = 2\n'
        "gpu_memory_bytes = 80e9\nmodel_memory_bytes = 16e9\nw_s = 0.005\nh_s = 0.0003\n"
    )
    assert load_profile(full).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    for body, err in [
        ('preset = "nope"\n', KeyError),
        ('name = "x"\nlayers = 1\n', ValueError),
        ("layers = [\n", ValueError),
        ("w_s = 1\n", ValueError),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(body)
        with pytest.raises(err):
            load_profile(bad)
