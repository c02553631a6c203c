"""Random overrides thrown at the real CLI entry: each gives a valid run or exit 2 with one line
naming a key, never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.run import main

SMALL_INT = st.integers(min_value=-3, max_value=8)
VALUES = st.one_of(SMALL_INT, st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from(["abc", "", "null", "true", "[1,2]", "{a: 1}", "1e9", "-0",
                                    "${oc.env:NOPE}", "'x y'", "off", "gpt2"]))
SIZES = {
    "model.n_layers": st.integers(-1, 3), "model.hidden": st.sampled_from([-8, 0, 8, 12, 16, 24]),
    "model.n_heads": st.integers(-1, 5), "model.n_kv_heads": st.integers(-1, 5),
    "model.ffn_hidden": st.integers(-4, 32), "model.seq_len": st.integers(-2, 24),
    "model.vocab": st.sampled_from([-1, 0, 100, 256, 300]),
    "train.steps": st.integers(-1, 3), "train.global_batch": st.integers(-1, 4),
    "train.micro_batch": st.integers(-1, 4), "train.lr": st.sampled_from([-1.0, 0.0, 1e-3]),
    "train.eval_every": st.integers(-1, 2), "data.val_frac": st.sampled_from([-0.1, 0.05, 0.7]),
    "layout.tp": st.integers(-2, 2), "layout.recompute": st.sampled_from(["none", "full", "x"]),
    "model.family": st.sampled_from(["llama", "gpt2", "bert"]),
}
ANY_KEYS = ["model.n_heads", "train.seed", "train.dtype", "launcher.name", "tracking.backend",
            "nope.key", "model.nokey", "model", "layout", "cluster", "train.grad_clip",
            "train.lr_schedule", "train.decay_steps", "train.init_from", "train.init_state"]


def _override(key: str, value) -> str:
    return f"{key}={value}"


overrides = st.lists(
    st.one_of(st.sampled_from(sorted(SIZES)).flatmap(lambda k: SIZES[k].map(
        lambda v, k=k: _override(k, v))),
        st.tuples(st.sampled_from(ANY_KEYS), VALUES).map(lambda kv: _override(*kv)),
        st.sampled_from(["garbage", "=3", "model=", "+x=1", "~train", "model.hidden==4"])),
    min_size=1, max_size=4)


@settings(max_examples=70, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ovs=overrides)
def test_random_overrides_run_or_exit_2_with_one_line(ovs, workdir, capsys):
    base = ["tracking=none", "model.hidden=16", "model.n_heads=2", "model.n_kv_heads=2",
            "model.n_layers=1", "model.ffn_hidden=32", "model.seq_len=16", "train.steps=2",
            "train.eval_every=1", "train.eval_batches=1", "train.global_batch=2",
            "train.micro_batch=2", "data.max_bytes=200000", "launcher=local"]
    capsys.readouterr()
    try:
        code = main(base + ovs)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    if code == 0:
        return
    assert code == 2, (ovs, err)
    assert "Traceback" not in err, (ovs, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, (ovs, err)
    named = {o.lstrip("+~").split("=")[0].split(".")[0] for o in ovs} | {
        o.lstrip("+~").split("=")[0] for o in ovs} | set(ovs)
    assert any(k and k in lines[0] for k in named) or "model." in lines[0] \
        or "train." in lines[0], (ovs, lines[0])


@pytest.mark.parametrize("ovs", [["model.n_heads=3"], ["model.n_kv_heads=3", "model.n_heads=4"],
                                 ["train.micro_batch=3"],
                                 # found by the property test above, and by one bad value per
                                 # schema field (each had ended in a traceback or a NaN loss)
                                 ["train.seed=-1"], ["train.lr=nan"], ["train.beta2=1.0"],
                                 ["model.norm_eps=0"], ["model.rope_theta=-1"],
                                 ["cluster.peak_fp32_flops=0"], ["train.threads=4294967296"],
                                 ["model.n_layers=99999999999999999999"]])
def test_known_bad_combinations(ovs, workdir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tracking=none", *ovs])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
