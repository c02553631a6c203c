"""Prepare and launch one job: choose the layout, record the run, write the job file, launch.

Every way of starting training goes through here: `workbench.run` (one run), `workbench.rerun`
(a recorded run again) and the sweep driver (one job per trial). Nothing is recorded before the
config and the layout are known to be valid, so bad input leaves no half-made run behind.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from workbench import layout as layouts
from workbench.compose import compose
from workbench.config import RunConfig
from workbench.data.corpus import load as load_data
from workbench.data.corpus import resolve_vocab
from workbench.errors import ConfigError
from workbench.job import JOB_NAME, Job, config_dict, flat_params
from workbench.job import config_yaml as to_yaml
from workbench.launch import make_launcher, threads_per_rank, world_size
from workbench.places import runs_root
from workbench.plan.search.rules import validate_layout
from workbench.track import manifest as manifests
from workbench.track.tracker import create_run, record_prepared
from workbench.train import branch


def choose_layout(cfg: RunConfig, world_size: int) -> layouts.Layout:
    """The concrete layout: as configured, or the planner's best for this world size."""
    if cfg.layout.auto:
        from workbench.plan.search.exhaustive import best_layout

        layout = best_layout(cfg.model, cfg.cluster, cfg.train, world_size, cfg.lowrank,
                             margin_bytes=cfg.layout.mem_margin_gib * 2**30)
    else:
        layout = layouts.resolve(cfg.layout, cfg.train, world_size)
    validate_layout(layout, cfg.model, world_size)
    return layout


# Keys prepare_job fills in after composing: a group choice (train=..., model=...) reaches them
# without asking for a value, and 0 asks for the value to be chosen. The run folder is how the
# job was found (the file holds it resolved), so it is never a conflict.
FILLED_IN = ("train.micro_batch", "train.threads", "model.vocab")


def conflicting_override(job: Job, cfg: RunConfig, overrides: List[str]
                         ) -> Optional[Tuple[str, Any, Any]]:
    """The first override that asks a run resumed from its job file for something the file does
    not hold, as (key, asked, recorded): dropping it silently would resume what the user did not
    ask for. A group choice (layout=fsdp) is compared over the whole group."""
    # the recorded side through the schema: a key newer than the job file reads as its
    # default, so a group choice (layout=fsdp) still resumes a run written before the key existed
    asked_flat = flat_params(config_dict(cfg))
    recorded_flat = flat_params(config_dict(job.run_config()))
    for text in overrides:
        named = text.split("=", 1)[0].lstrip("+~")
        if "=" not in text or named.split(".")[0] in ("sweep", "hydra"):
            continue
        for key, asked in asked_flat.items():
            if key != named and not key.startswith(named + "."):
                continue
            if key == "train.run_dir" or (key in FILLED_IN and (key != named or asked in (0, ""))):
                continue
            if key == "train.init_from" and _names(asked, recorded_flat.get(key)):
                continue
            # through JSON, as the job file was written: tuples compare as its lists
            asked, recorded = json.loads(json.dumps([asked, recorded_flat.get(key)]))
            if asked != recorded:
                return key, asked, recorded
    return None


def _names(asked: str, recorded: str) -> bool:
    """`train.init_from` as asked names the checkpoint the job file recorded: that checkpoint,
    or the run folder it was found in (whose newest checkpoint may have moved on since)."""
    if not asked or not recorded:
        return asked == recorded
    here = Path(asked).expanduser().resolve()
    return here == Path(recorded) or here in Path(recorded).parents


def new_run_dir(cfg: RunConfig) -> Path:
    if cfg.train.run_dir:
        return Path(cfg.train.run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return runs_root() / f"{stamp}-{cfg.model.name}-{secrets.token_hex(3)}"


def check_fits(cfg: RunConfig, layout: layouts.Layout) -> None:
    """Refuse, as bad input, a layout the cost model predicts does not fit (layout.check_memory):
    on GPUs it would die in its first step after the queue and the start-up, on a CPU it can
    drive the machine into swap or the OOM killer. Runs over pools are checked per stage by
    their placement instead; a run the model cannot price is let through."""
    if not cfg.layout.check_memory or cfg.launcher.stage_pools:
        return
    from workbench.plan.cost.estimate import estimate

    try:
        est = estimate(cfg.model, cfg.cluster, cfg.train, layout, cfg.lowrank)
    except (ConfigError, ValueError, ZeroDivisionError):
        return
    margin = cfg.layout.mem_margin_gib
    # CPU ranks on one machine share its memory (cluster.hbm_bytes: the host's); a GPU its own
    sharing = layout.world_size // max(cfg.launcher.nodes, 1) if cfg.cluster.device == "cpu" \
        else 1
    if not est.fits_with(margin * 2**30, sharing):
        per = f" x {sharing} ranks on one machine" if sharing > 1 else " per device"
        raise ConfigError("layout", layout.key(),
                          f"predicted peak {est.peak_mem_bytes / 2**30:.1f} GiB{per}"
                          f"{f' + {margin:g} GiB margin' if margin else ''} exceeds "
                          f"cluster.hbm_bytes ({est.hbm_bytes / 2**30:.1f} GiB, "
                          f"{cfg.cluster.name}): layout=auto picks one that fits; "
                          "layout.check_memory=false runs it anyway")


def prepare_job(cfg: RunConfig, overrides: List[str], world_size: int,
                extra_tags: Optional[Dict[str, str]] = None,
                parent_run_id: Optional[str] = None, check_memory: bool = False) -> Job:
    """Validate everything, then record the run (params, tags, manifest) and write its job
    file. Nothing is recorded before the config and layout are known to be valid (and, with
    `check_memory`, predicted to fit: a new run from the command line; a sweep filters its
    own trials, a rerun repeats what ran)."""
    data = load_data(cfg.data)
    cfg.model.vocab = resolve_vocab(cfg.model.vocab, data, overrides)  # the tokenizer's size
    layout = choose_layout(cfg, world_size)
    if check_memory:
        check_fits(cfg, layout)
    placed = _placement_tags(cfg, layout, world_size)  # before anything is recorded
    init = branch.find(cfg.train.init_from) if cfg.train.init_from else None
    if init is not None:
        branch.check(init, cfg)
        placed |= init.tags()
    run_dir = new_run_dir(cfg).resolve()
    resolved = config_dict(cfg)
    resolved["train"]["run_dir"] = str(run_dir)
    if init is not None:  # one checkpoint, whatever the parent run writes from now on
        resolved["train"]["init_from"] = str(init.checkpoint)
        run_dir.mkdir(parents=True, exist_ok=True)
        branch.prepare(init, run_dir)
    resolved["train"]["micro_batch"] = layout.micro_batch  # 0 (auto) is logged as resolved
    resolved["train"]["threads"] = threads_per_rank(cfg.launcher, cfg.train.threads)  # likewise
    config_yaml = to_yaml(resolved)
    manifest = manifests.build(config_yaml, overrides, cfg.train.seed, data.fingerprint)
    manifest["tokenizer_hash"] = data.tokenizer_hash
    tags = {**manifests.tags(manifest), "wb.layout": layout.key(),
            "wb.model": cfg.model.name, "wb.cluster": cfg.cluster.name,
            "wb.launcher": cfg.launcher.name, "wb.run_dir": str(run_dir),
            "wb.tokenizer_hash": data.tokenizer_hash[:16], **placed,
            **(extra_tags or {})}
    run_name = f"{cfg.model.name}-{layout.key()}-s{cfg.train.seed}"
    if cfg.lowrank.mode != "off":  # runs compared side by side need telling apart
        run_name += f"-{cfg.lowrank.mode}"
    run_id = create_run(cfg.tracking, run_name, tags, parent_run_id)
    job = Job(config=resolved, layout=layout.key(), run_dir=str(run_dir), run_id=run_id,
              data_dir=str(data.folder), world_size=world_size, tags=tags)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    (run_dir / "manifest.json").write_text(_json(manifest))
    if run_id:
        params = flat_params(resolved) | layout.as_params() | {
            "world_size": world_size, "layout": layout.key(), "n_params": _n_params(cfg)}
        record_prepared(cfg.tracking.resolved_uri(), run_id, params, _prediction(cfg, layout),
                        [run_dir / "config.yaml", run_dir / "manifest.json"], "manifest")
    job.save()
    return job


def _placement_tags(cfg: RunConfig, layout: layouts.Layout, world_size: int) -> Dict[str, str]:
    """Each pipeline rank's pool, partition and layers when the run spans pools
    (launcher.stage_pools), validated against the cluster and layout; {} otherwise."""
    if not cfg.launcher.stage_pools:
        return {}
    from workbench.launch.hetjob import placement, stage_tags

    return stage_tags(placement(cfg, layout, world_size), layout, cfg.model.n_layers)


def _n_params(cfg: RunConfig) -> int:
    from workbench.train.counts import n_params

    return n_params(cfg.model)


def _prediction(cfg: RunConfig, layout: layouts.Layout) -> Dict[str, float]:
    """The cost model's prediction (`pred/*`), logged beside what will be measured so that
    calibration is a query; {} when there is no planner or it cannot price this run."""
    try:
        from workbench.plan.cost.estimate import estimate
    except ImportError:
        return {}
    try:
        est = estimate(cfg.model, cfg.cluster, cfg.train, layout, cfg.lowrank)
    except (ConfigError, ValueError, ZeroDivisionError):
        return {}
    return {f"pred/{k}": v for k, v in est.as_metrics().items()}


def _json(obj) -> str:
    return json.dumps(obj, indent=1, default=str)


def existing_job(cfg: RunConfig) -> Optional[Job]:
    """`train.run_dir=DIR` naming a run that already has a job file resumes that run."""
    if cfg.train.run_dir and (Path(cfg.train.run_dir) / JOB_NAME).exists():
        return Job.load(Path(cfg.train.run_dir) / JOB_NAME)
    return None


def launch(cfg: RunConfig, job: Job) -> Dict[str, float]:
    return make_launcher(cfg.launcher).launch(job)


def summary(cfg: RunConfig, job: Job, last: Dict[str, float]) -> str:
    lines = [f"run dir: {job.run_dir}"]
    if "loss" in last:
        val = last.get("val_loss", float("nan"))
        lines.append(f"final loss {last['loss']:.4f}  val_loss {val:.4f}  "
                     f"tokens/s {last['tokens_per_s']:.0f}")
    if job.run_id:
        uri = cfg.tracking.resolved_uri()
        lines.append(f"mlflow run: {job.run_id}")
        if uri.startswith(("http://", "https://")):  # the tracking server is the UI
            lines.append(f"open the UI: {uri}")
        else:
            lines.append(f"open the UI: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 "
                         "--port 5000")
    lines.append(f"resume or continue: python -m workbench.train {job.path}")
    return "\n".join(lines)


def start(overrides: List[str]) -> Tuple[RunConfig, Job]:
    """Compose and validate, then reuse the run named by train.run_dir or record a new one."""
    from workbench.track.store import check_tracking

    cfg = compose(overrides)
    job = existing_job(cfg)
    if job is not None:
        conflict = conflicting_override(job, cfg, overrides)
        if conflict:
            key, asked, recorded = conflict
            raise ConfigError(key, asked, f"the run in {job.run_dir} holds {recorded!r} and its "
                              "job file defines it: resume without this override, or start a "
                              "new run in another train.run_dir")
        print(f"resuming run in {job.run_dir} (its job file defines the run)", file=sys.stderr)
        check_tracking(job.run_config())
        return job.run_config(), job
    check_tracking(cfg)  # the server answers; no sqlite written from several nodes
    return cfg, prepare_job(cfg, overrides, world_size(cfg.launcher), check_memory=True)
