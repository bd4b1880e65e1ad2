"""Where a (re)starting run resumes from: the choice as a pure function, and carrying it out.

:func:`decide` is the choice, from plain values only -- what node memory offers, what the durable
tier offers, what failed so far -- like :func:`elastic_ddp.memory.policy.choose_resume` (which it
builds on) and :func:`elastic_ddp.rendezvous.rounds.decide`: the newest state anywhere, node memory
on a tie, a durable checkpoint only once it verified, and the next source when a read fails.

:func:`resume` carries it out (collective, every rank alike): it surveys node memory, lists and
verifies the durable tier, reads what :func:`decide` names and asks again when a read fails.
``checkpoint.resume=never`` starts afresh (refusing, or with ``checkpoint.overwrite`` clearing, a
URL that holds checkpoints) and a named checkpoint is read as named. :func:`init_from` then gives
the pretrained weights of a run that resumed nothing, and :func:`record_resume` says where the
state came from.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import CheckpointError, CheckpointInfo, CheckpointManager
from elastic_ddp.checkpoint.pretrained import InitFromError, load_pretrained, source_record
from elastic_ddp.config import Config, ConfigError, identity_differences
from elastic_ddp.worker.failures import FailureReport
from elastic_ddp.worker.lifecycle import RunError
from elastic_ddp.memory.policy import Candidate, choose_resume
from elastic_ddp.memory.tier import MemoryTier, MemoryTierError
from elastic_ddp.worker.metrics import Metrics
from elastic_ddp.state import Stateful

__all__ = [
    "AUTO", "DURABLE", "FRESH", "MEMORY", "NAMED", "NEVER", "VERIFY", "Decision", "Resumed", "decide", "init_from",
    "mode", "record_resume", "resume",
]  # fmt: skip

log = logging.getLogger(__name__)

# checkpoint.resume's three kinds.
AUTO, NEVER, NAMED = "auto", "never", "named"
# What decide() says to do next.
MEMORY = "memory"  # read the state of ``step`` from node ``node``'s memory
VERIFY = "verify"  # verify the durable tier (its newest checkpoint that verifies), then decide again
DURABLE = "durable"  # load the verified durable checkpoint of ``step``
FRESH = "fresh"  # nothing to resume: start from the beginning


def mode(resume: str) -> str:
    """The kind of ``checkpoint.resume``: :data:`AUTO`, :data:`NEVER`, or :data:`NAMED` (a step or URL)."""
    resume = resume.strip()
    return resume if resume in (AUTO, NEVER) else NAMED


@dataclass(frozen=True)
class Decision:
    """What to do next to resume: ``action`` (:data:`MEMORY`, :data:`VERIFY`, :data:`DURABLE` or
    :data:`FRESH`), the ``step`` it resumes, the ``node`` serving it from memory, and why."""

    action: str
    step: int = 0
    node: int = -1
    why: str = ""


def decide(
    memory: Sequence[Candidate], durable: int | None, *, verified: bool = False, failed: Collection[int] = ()
) -> Decision:
    """The next step of an automatic resume (``checkpoint.resume=auto``), from plain values.

    ``memory``: every complete state node memory offers (:meth:`~elastic_ddp.memory.tier.Survey.candidates`);
    ``durable``: the newest durable checkpoint's step -- the newest listed one while not ``verified``,
    else the newest that verified (None: there is none); ``failed``: the nodes whose memory could not
    be read. The newest state anywhere wins, node memory on a tie (:func:`choose_resume`); a durable
    checkpoint is first verified (:data:`VERIFY`), and once verified it is loaded when it is at least as
    new as anything node memory holds -- else the newer state in memory is read, or, when only a state
    not every rank holds its own part of is newer, the verified checkpoint after all.
    """
    left = [c for c in memory if c.node not in failed]
    newest = max((c.step for c in left), default=None)
    note = f"; node memory of node(s) {sorted(set(failed))} could not be read" if failed else ""
    if verified and durable is not None and (newest is None or durable >= newest):
        held = "none" if newest is None else f"step {newest}"
        return Decision(DURABLE, durable, why=f"the durable checkpoint of step {durable} verified, and node memory "
                                              f"holds nothing newer ({held}){note}")  # fmt: skip
    choice = choose_resume(left, durable)
    if choice.tier == "memory":
        return Decision(MEMORY, choice.step, choice.node, choice.why + note)
    if choice.tier == "durable":
        return Decision(DURABLE if verified else VERIFY, choice.step, why=choice.why + note)
    why = choice.why if not verified else "no state in node memory and no durable checkpoint that verifies"
    return Decision(FRESH, why=why + note)


@dataclass(frozen=True)
class Resumed:
    """Where this attempt's state came from.

    ``tier``: ``"memory"``, ``"durable"`` or None (nothing resumed); ``step``: the step resumed (0:
    none); ``source``: ``memory:nodeN`` or the checkpoint's URL; ``checkpoint``: the durable checkpoint
    resumed; ``newest_durable``: the newest committed durable checkpoint (an automatic resume lists
    it); ``steps_redone``: how many completed steps this attempt trains again (None: unknown).
    """

    tier: str | None = None
    step: int = 0
    source: str | None = None
    checkpoint: CheckpointInfo | None = None
    newest_durable: CheckpointInfo | None = None
    steps_redone: int | None = None


def _redone(step: int, last_step: int | None) -> int | None:
    return max(last_step - step, 0) if last_step is not None else None


def resume(
    cfg: Config, checkpoints: CheckpointManager, memory: MemoryTier | None, state: Mapping[str, Stateful], *, rank: int
) -> Resumed:
    """Resume ``state`` from the newest state anywhere (collective; see the module docstring).

    A memory tier that turned itself off for this attempt (:attr:`MemoryTier.disabled`) is still read,
    then closed. Raises :class:`RunError` when the tier cannot work or a checkpoint belongs to a run
    with other identity settings.
    """
    kind = mode(cfg.checkpoint.resume)
    survey = None
    try:
        if memory is not None:
            try:
                # Only an automatic resume may take node memory; any other start forgets it.
                survey = memory.survey(state, fresh=kind != AUTO)
            except MemoryTierError as exc:
                raise RunError(str(exc)) from None
        last_step = survey.last_step() if survey is not None else None
        if kind == NEVER:
            _start_afresh(cfg, checkpoints, rank)
            return Resumed()
        if kind == NAMED:
            return _load_durable(cfg, checkpoints, checkpoints.resolve(cfg.checkpoint.resume), state, last_step, rank)
        listed = checkpoints.list_collective()
        newest_durable = listed[-1] if listed else None
        candidates = survey.candidates() if survey is not None else []
        durable, verified, info, failed = listed[-1].step if listed else None, False, None, set()
        while True:
            decision = decide(candidates, durable, verified=verified, failed=failed)
            log.info("[%d/-] Resume: %s.", rank, decision.why)
            if decision.action == MEMORY:
                try:
                    restored = memory.restore(survey, decision.node, decision.step, state)
                except MemoryTierError as exc:
                    raise RunError(str(exc)) from None
                if restored:
                    redone = _redone(decision.step, last_step)
                    return Resumed("memory", decision.step, f"memory:node{decision.node}", None, newest_durable, redone)
                failed.add(decision.node)
            elif decision.action == VERIFY:
                info = checkpoints.latest()  # verified; falls back past damaged checkpoints
                durable, verified = (info.step if info is not None else None), True
            elif decision.action == DURABLE:
                resumed = _load_durable(cfg, checkpoints, info, state, last_step, rank)
                return replace(resumed, newest_durable=newest_durable)
            else:
                return Resumed(newest_durable=newest_durable)
    finally:
        if memory is not None and memory.disabled:
            memory.close()  # off for this attempt's saves; what the nodes held was still read


def _load_durable(
    cfg: Config, checkpoints: CheckpointManager, info: CheckpointInfo | None, state: Mapping[str, Stateful],
    last_step: int | None, rank: int,
) -> Resumed:  # fmt: skip
    if info is None:
        return Resumed()
    differences = identity_differences(info.identity, cfg.identity())
    if differences and not cfg.checkpoint.allow_identity_change:
        raise RunError(
            f"Checkpoint {info.url} belongs to a run with other identity settings, so resuming it here "
            f"would mix two runs: {'; '.join(differences)}. Start this one elsewhere (another run.name or "
            "checkpoint.url), use the checkpoint's values, or pass --checkpoint.allow_identity_change=true "
            "to continue that run with the new values."
        )
    if differences:
        log.warning("[%d/%d] Resuming %s with changed identity settings: %s.", rank, info.step, info.url,
                    "; ".join(differences))  # fmt: skip
    checkpoints.load(info, state)
    return Resumed("durable", info.step, info.url, info, steps_redone=_redone(info.step, last_step))


def _start_afresh(cfg: Config, checkpoints: CheckpointManager, rank: int) -> None:
    """``checkpoint.resume=never``: refuse a URL holding another run's checkpoints, or clear it."""
    existing = checkpoints.list_collective()
    if not existing:
        return
    steps = ", ".join(str(info.step) for info in existing[-5:])
    if not cfg.checkpoint.overwrite:
        raise RunError(
            f"checkpoint.resume=never, but {checkpoints.url} already holds {len(existing)} checkpoint(s) "
            f"(steps ... {steps}). A new run there would mix its checkpoints with theirs. Use another "
            "checkpoint.url (or run.name), resume them (checkpoint.resume=auto), or pass "
            "--checkpoint.overwrite=true to delete them and start over."
        )
    log.warning("[%d/0] checkpoint.overwrite: deleting %d checkpoint(s) under %s.", rank, len(existing),
                checkpoints.url)  # fmt: skip
    checkpoints.remove_all()


def init_from(
    cfg: Config, resumed: Resumed, state: Mapping[str, Stateful], model: Stateful, *, rank: int, world_size: int,
    device: torch.device, control_group: Any,
) -> tuple[dict[str, str] | None, str | None]:  # fmt: skip
    """The pretrained weights this run descends from (``checkpoint.init_from``), for its manifests,
    and the event to record; loaded into ``model`` here when the run resumed nothing (collective).

    After a resume the source is carried forward from the run's own manifests -- the resumed one,
    or for a memory-tier resume the newest durable one -- not taken from the settings: a relaunch
    may name another source (or none) and still resume, and its checkpoints name what the weights
    really came from. A memory-tier resume before the run's first durable save has no manifest
    to carry it from; the settings' source is then hashed again (it was loaded by this run).
    Raises :class:`ConfigError` when the source is missing or does not fit the model (a bad setting).
    """
    ckpt = cfg.checkpoint
    if resumed.tier == "durable":
        return resumed.checkpoint.manifest.get("init_from"), None
    if resumed.tier == "memory" and resumed.newest_durable is not None:
        return resumed.newest_durable.manifest.get("init_from"), None
    if not ckpt.init_from:
        return None, None
    if resumed.tier == "memory":
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = source_record(ckpt.init_from, ckpt.storage_options)
            except CheckpointError as exc:  # the weights are resumed; only the record is lost
                log.warning("[%d/%d] The manifests will not name checkpoint.init_from: %s", rank, resumed.step, exc)
        if dist.is_initialized() and world_size > 1:
            dist.broadcast_object_list(box, src=0, group=control_group)
        return box[0], None
    try:
        loaded = load_pretrained(
            ckpt.init_from, model, missing_ok=ckpt.init_from_missing_ok, objects=ckpt.init_from_objects,
            registered=state, storage_options=ckpt.storage_options, device=device, control_group=control_group,
        )  # fmt: skip
    except InitFromError as exc:
        if exc.retryable:
            raise
        # A source that is missing or does not fit the model is a bad setting: every node ends
        # now with the message, instead of each restart failing the same way.
        raise ConfigError(str(exc)) from None
    record = loaded.record
    kept = f"; kept the model's own {', '.join(loaded.kept)}" if loaded.kept else ""
    objects = "".join(f"; {name} from {how}" for name, how in loaded.objects)
    event = (
        f"Initialised the model from {record['url']} ({record['format']}, BLAKE3 {record['blake3']}): "
        f"{loaded.tensors} tensors, {loaded.bytes} bytes{kept}{objects}"
    )
    return record, event


def record_resume(
    resumed: Resumed, metrics: Metrics, failures: FailureReport, *, is_main: bool, world_size: int
) -> Resumed:
    """Say where this attempt's state came from and how many completed steps it trains again; the
    same ``resumed`` with ``steps_redone`` filled in from the metrics' record when the nodes did not
    know it."""
    metrics.event(f"Resumed from {resumed.source} (step {resumed.step})")
    redone = resumed.steps_redone
    if redone is None:
        previous = metrics.previous_step()
        redone = max(previous - resumed.step, 0) if previous is not None else None
    metrics.event(
        f"Resumed from the {resumed.tier} tier at step {resumed.step}: "
        + ("steps redone unknown" if redone is None else f"{redone} step(s) redone")
    )
    if is_main:
        failures.record_resume(tier=resumed.tier, step=resumed.step, source=resumed.source, steps_redone=redone,
                               world_size=world_size)  # fmt: skip
    return replace(resumed, steps_redone=redone)


def record_lost_history(metrics: Metrics, failures: FailureReport, *, is_main: bool, world_size: int) -> int | None:
    """A start that resumes nothing although an earlier attempt of the run trained (its progress
    record says to which step): say so loudly -- an error line and a TensorBoard event on rank 0, a
    resume record with the steps redone -- instead of starting over in silence. The steps redone,
    or None when nothing was lost (a new run, or one never logged a step)."""
    previous = metrics.previous_step()
    if not previous:
        return None
    text = (
        f"Nothing to resume, though an earlier attempt of this run trained to step {previous} at least (the last "
        f"step its progress record logged): no checkpoint of those steps was committed in either tier, or none "
        f"can be read. Training "
        f"starts again at step 1: {previous} step(s) redone. An earlier attempt's log says why its checkpoints "
        f"were lost (a stop past checkpoint.grace_s, failed saves, a deleted checkpoint directory)."
    )
    log.error("%s", text)
    metrics.event(text)
    if is_main:
        failures.record_resume(tier="none", step=0, source="", steps_redone=previous, world_size=world_size)
    return previous
