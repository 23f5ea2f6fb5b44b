"""Optuna studies in a database, shared by worker processes, run exactly ``trials`` times.

Storage is an Optuna :class:`~optuna.storages.RDBStorage`: a SQLite file in the bench
directory by default, or a PostgreSQL URL so that processes on several machines share one
study (Akiba et al., "Optuna", KDD 2019).

Exactly-once trials across workers and restarts
    When a study is created its ``trials`` slots are enqueued as WAITING trials, once: the
    worker whose ``create_study`` succeeds (study names are unique in the database, so exactly
    one does) enqueues them and records it in the study's user attributes. Every worker then
    claims WAITING trials one at a time (the storage's compare-and-set on the trial state makes
    a claim atomic) and stops when none is left, so no worker ever creates an extra trial. TPE
    samples each claimed trial's parameters from all finished trials at that moment.

Failures and interruptions
    An exception in a trial (a NaN loss -> :class:`~dmlkit.exceptions.NonFiniteError`, out of
    memory, anything else) marks it FAIL, stores the error text in its user attributes, and the
    study goes on; a failed (or pruned) trial uses up its slot (:func:`count_finished`) but is not
    *completed* (:func:`count_completed`): what users are shown as "completed" and what model
    selection uses are COMPLETE trials only. A *killed* worker leaves a RUNNING trial
    behind; workers record heartbeats, and a trial whose heartbeat is older than the grace
    period (or, for the single local coordinator, any RUNNING trial found at start-up) is
    marked FAIL and re-enqueued with the same parameters
    (:class:`optuna.storages.RetryHeartbeatStaleTrialCallback`). Interrupted trials do not count,
    so a resumed study finishes exactly the requested number of trials, none run twice. The
    retry is claimed before the slots after the interrupted one, so a single worker's resumed
    search samples the same points as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dmlkit.exceptions import ConfigError, DmlkitError, require
from dmlkit.utils import open_appending

__all__ = [
    "FINGERPRINT_VERSION",
    "claim_waiting_trial",
    "completed_and_failed",
    "count_completed",
    "count_finished",
    "in_memory_storage",
    "make_storage",
    "open_study",
    "resolve_storage_url",
    "run_worker",
    "slot_order",
    "study_summary",
]

_SLOTS_ATTR = "dmlkit_slots"
_HEARTBEAT_ATTR = "dmlkit_heartbeat"
_FINGERPRINT_ATTR = "dmlkit_fingerprint"
#: How the stored ``dmlkit_fingerprint`` was computed (in ``dmlkit_fingerprint_version``, beside
#: it, so an older dmlkit still reads the fingerprint): 2 holds the sampler settings where not
#: the defaults. A study without it was created by a dmlkit that did not record it, whose key
#: may leave them out (:func:`dmlkit.protocol.stages.method_fingerprint` ``legacy``).
FINGERPRINT_VERSION = 2
_FINGERPRINT_VERSION_ATTR = "dmlkit_fingerprint_version"
# libpq's connect_timeout (seconds) for a PostgreSQL URL that gives none: a host that accepts the
# TCP connection but never answers otherwise made `dmlkit bench` hang for ever
_CONNECT_TIMEOUT_S = 10


def resolve_storage_url(storage: str | None, bench_dir: str | Path) -> str:
    """``None`` -> ``sqlite:///BENCH_DIR/study.db``; ``postgresql://`` -> the psycopg 3 driver."""
    if storage is None:
        path = Path(bench_dir).resolve() / "study.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    if storage.startswith("postgres://"):
        storage = "postgresql://" + storage[len("postgres://"):]
    if storage.startswith("postgresql://"):
        # SQLAlchemy's default PostgreSQL driver is psycopg2; dmlkit[postgres] installs psycopg 3
        require("psycopg", "postgres")
        storage = "postgresql+psycopg://" + storage[len("postgresql://"):]
    return storage


def check_sqlite_folder(url: str | None) -> None:
    """Refuse a SQLite file URL whose folder does not exist, in one :class:`ConfigError` line
    (opening it failed on its lock file, with a hint that the study file was damaged)."""
    if not url or not url.startswith("sqlite:///") or url.split("?", 1)[0].endswith(":memory:"):
        return
    path = Path(url[len("sqlite:///"):].split("?", 1)[0])
    if not path.parent.is_dir():
        raise ConfigError(f"protocol.storage {_redact(url)}: the folder {path.parent} does not exist; "
                          "create it, or leave protocol.storage out for BENCH_DIR/study.db")


def in_memory_storage(storage: str | None) -> bool:
    """Whether an Optuna storage URL names an in-memory SQLite database (``sqlite://``,
    ``sqlite:///:memory:``), which only the process that opened it can see."""
    if storage is None or not storage.startswith("sqlite:"):
        return False
    path = storage.split("://", 1)[1] if "://" in storage else ""
    return path in ("", "/") or path.lstrip("/").split("?")[0] in ("", ":memory:")


def make_storage(url: str, *, heartbeat_interval: int = 30, grace_period: int = 120):
    """An :class:`optuna.storages.RDBStorage` with heartbeats and retry of stale trials."""
    import optuna
    from optuna.storages import RDBStorage

    check_sqlite_folder(url)

    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 120}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
        if url.startswith("postgresql") and "connect_timeout=" not in url:
            engine_kwargs["connect_args"] = {"connect_timeout": _CONNECT_TIMEOUT_S}
    last_exc: Exception | None = None
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                with _sqlite_file_lock(url):  # one process creates a new SQLite schema at a time
                    return RDBStorage(
                        url,
                        engine_kwargs=engine_kwargs,
                        heartbeat_interval=heartbeat_interval,
                        grace_period=grace_period,
                        heartbeat_stale_trial_callback=_RetryInterrupted(),
                    )
        except Exception as exc:  # sqlalchemy.exc.OperationalError and friends
            if isinstance(exc, DmlkitError):
                raise
            last_exc = exc
            # two workers creating the schema at the same time: the loser retries
            text = str(exc)
            if any(k in text for k in ("already exists", "UniqueViolation", "UNIQUE constraint",
                                       "IntegrityError", "locked")):
                time.sleep(0.5 * (attempt + 1))
                continue
            break
    # sqlalchemy's message spans lines ([SQL: ...], a link to its docs): its first line says it
    reason = (str(last_exc).strip().splitlines() or [""])[0][:300]
    hint = ("the file may be damaged or not an Optuna study: move it away to start the search "
            "afresh" if url.startswith("sqlite:") else "check the URL, that the server runs and the "
            "database exists")
    raise ConfigError(f"cannot open the study storage {_redact(url)}: "
                      f"{last_exc.__class__.__name__}: {reason}; {hint}") from last_exc


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else url
    return url


class _RetryInterrupted:
    """Re-enqueue a stale (interrupted) trial with the same parameters.

    The new WAITING trial records the interrupted trial's number in its ``retry_history``
    system attribute; :func:`interrupted_numbers` reads it back.
    """

    def __call__(self, study, trial) -> None:
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            RetryHeartbeatStaleTrialCallback()(study, trial)


def interrupted_numbers(trials) -> set[int]:
    """Numbers of trials that were interrupted (killed worker) and re-enqueued."""
    out: set[int] = set()
    for t in trials:
        out.update(int(n) for n in t.system_attrs.get("retry_history", []))
    return out


def make_sampler(kind: str, seed: int, n_startup_trials: int):
    """A seeded Optuna sampler: ``tpe`` (Bergstra et al. 2011; constant liar for parallel
    workers, so running trials are not suggested twice) or ``random``."""
    import optuna

    if kind == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials,
                                              constant_liar=True)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"unknown search sampler {kind!r}: use 'tpe' or 'random'")


def open_study(
    storage, name: str, trials: int, *, sampler: str = "tpe", seed: int = 0, n_startup_trials: int = 10,
    fingerprint: dict[str, Any] | None = None, heartbeat: dict[str, int] | None = None,
    wait_s: float = 120.0, legacy_fingerprint: dict[str, Any] | None = None, legacy_checked: bool = False,
):
    """Create or load study ``name`` (maximising) with exactly ``trials`` slots enqueued once.

    ``fingerprint`` (the method's search space, sampler and fixed settings) must match a loaded
    study's: resuming a study with another search space would mix incomparable trials.
    ``heartbeat`` (``heartbeat_interval``, ``grace_period``) must match too: a worker with a
    shorter grace period than another's heartbeat interval failed that worker's live trials.
    ``legacy_fingerprint`` is the key an older dmlkit stored without the sampler settings;
    ``legacy_checked`` says the caller has shown them to be the ones the study was made with
    (:func:`_check_fingerprint`).
    """
    import optuna

    smp = make_sampler(sampler, seed, n_startup_trials)
    for attempt in range(20):
        try:
            try:
                study = optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                            sampler=smp)
                created = True
            except optuna.exceptions.DuplicatedStudyError:
                study = optuna.load_study(storage=storage, study_name=name, sampler=smp)
                created = False
            break
        except Exception as exc:  # SQLite "database is locked" while another worker writes
            if "locked" not in str(exc) or attempt == 19:
                raise
            time.sleep(0.2 * (attempt + 1))
    if created:
        if fingerprint is not None:
            study.set_user_attr(_FINGERPRINT_ATTR, fingerprint)
            study.set_user_attr(_FINGERPRINT_VERSION_ATTR, FINGERPRINT_VERSION)
        if heartbeat is not None:
            study.set_user_attr(_HEARTBEAT_ATTR, heartbeat)
        grow_slots(study, trials)
        return study
    deadline = time.monotonic() + wait_s
    while _SLOTS_ATTR not in study.user_attrs:  # another worker is creating it right now
        if time.monotonic() > deadline:
            grow_slots(study, trials)  # the creator died before enqueueing: enqueue the rest
            break
        time.sleep(0.5)
    _check_fingerprint(study, name, fingerprint, legacy_fingerprint, legacy_checked)
    _check_heartbeat(study, name, heartbeat)
    slots = int(study.user_attrs[_SLOTS_ATTR])
    if trials > slots:  # the user asked for more trials: add slots
        grow_slots(study, trials)
    elif trials < slots:
        raise ConfigError(
            f"study {name!r} already has {slots} trial slots; protocol.trials = {trials} cannot shrink it: "
            f"search with --set protocol.trials={slots}, or build the table from each method's first "
            f"{trials} trials with --stage final"
        )
    return study


def _check_fingerprint(study, name: str, fingerprint: dict[str, Any] | None,
                       legacy: dict[str, Any] | None, legacy_checked: bool) -> None:
    """Refuse a study whose key is not ``fingerprint``; a study without a recorded key accepts any.

    A study without :data:`FINGERPRINT_VERSION` may hold the key of a dmlkit whose key left out
    the sampler settings (``legacy``): accepted only where ``legacy_checked``, as nothing else
    shows they were the same. An unversioned study that is accepted gets this dmlkit's key."""
    old = study.user_attrs.get(_FINGERPRINT_ATTR)
    if fingerprint is None or old is None:
        return
    versioned = _FINGERPRINT_VERSION_ATTR in study.user_attrs
    if old != fingerprint and (versioned or legacy is None or old != legacy):
        raise ConfigError(
            f"study {name!r} was created with another search space or fixed settings (or "
            "protocol.sampler, sampler_seed, n_startup_trials); use a new bench directory "
            "(or study_prefix) instead of resuming it")
    if old != fingerprint and not legacy_checked:
        raise ConfigError(
            f"study {name!r} was created by an older dmlkit, which did not record "
            "protocol.sampler, sampler_seed and n_startup_trials; this config sets them to other "
            "than the defaults, and only a study in its bench directory's own study.db (checked "
            "against that directory's config.yaml) shows they are the same; use a new bench "
            "directory (or study_prefix) instead of resuming it")
    if not versioned:  # this dmlkit's key from now on (an older dmlkit refuses other settings)
        study.set_user_attr(_FINGERPRINT_ATTR, fingerprint)
        study.set_user_attr(_FINGERPRINT_VERSION_ATTR, FINGERPRINT_VERSION)


def _check_heartbeat(study, name: str, heartbeat: dict[str, int] | None) -> None:
    """Refuse a worker whose heartbeat settings differ from those the study was created with
    (studies created before they were recorded accept any)."""
    old = study.user_attrs.get(_HEARTBEAT_ATTR)
    if heartbeat is None or old is None or old == heartbeat:
        return
    def show(values: dict[str, int], sep: str, prefix: str = "") -> str:
        return sep.join(f"{prefix}{k}={v}" for k, v in sorted(values.items()))

    raise ConfigError(f"study {name!r} was created with protocol {show(old, ', ')}; this worker has "
                      f"{show(heartbeat, ', ')}: every worker must use the study's values (a shorter "
                      f"grace period fails other workers' live trials); start it with "
                      f"{show(old, ' ', '--set protocol.')}")


def grow_slots(study, trials: int) -> None:
    """Bring the study to ``trials`` enqueued slots, atomically across workers.

    Under :func:`_slots_lock` the slot count is read afresh (the ``dmlkit_slots`` attribute, or
    the trials a creator that died got to enqueue) and only the missing slots are added: two
    workers raising ``protocol.trials`` at once each read the old count and both added the
    difference, leaving more slots than asked for.
    """
    with _slots_lock(study):
        slots = study._storage.get_study_user_attrs(study._study_id).get(_SLOTS_ATTR)
        current = len(study.get_trials(deepcopy=False)) if slots is None else int(slots)
        if trials <= current:
            return
        for _ in range(trials - current):
            study.enqueue_trial({}, skip_if_exists=False)
        study.set_user_attr(_SLOTS_ATTR, trials)


# the first key of the PostgreSQL advisory lock on a study's slots ("dmlk"); the second is its id
_SLOTS_LOCK_NAMESPACE = 0x646D6C6B
_SLOTS_THREAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _slots_lock(study) -> Iterator[None]:
    """Serialise changes of a study's slots: between threads of this process, between processes
    sharing a SQLite file (:func:`storage_lock`), and on PostgreSQL through a transaction-level
    advisory lock on the study's id, held on a connection of its own until the change is done."""
    with _SLOTS_THREAD_LOCK, storage_lock(study._storage):
        engine = _storage_attr(study._storage, "engine")
        if engine is None or engine.dialect.name != "postgresql":
            yield
            return
        from sqlalchemy import text

        with engine.connect() as conn, conn.begin():
            conn.execute(text("SELECT pg_advisory_xact_lock(:ns, :id)"),
                         {"ns": _SLOTS_LOCK_NAMESPACE, "id": int(study._study_id)})
            yield


def counted_trials(study, trials: list | None = None) -> list:
    """Trials that used up their slot: COMPLETE + PRUNED + FAIL, without interrupted ones
    (those are retried). Only the COMPLETE ones are *completed* (:func:`count_completed`).

    A PRUNED trial (an ``optuna.TrialPruned`` raised in the objective, :func:`run_worker`) is
    never re-run, so it must use up its slot as a failed one does: left out, the study never
    reached ``trials`` and the final stage refused it for ever as "not over"."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False) if trials is None else trials
    skip = interrupted_numbers(trials)
    return [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and t.number not in skip)]


def count_finished(study) -> int:
    """How many trial slots are used up, completed or failed (:func:`counted_trials`): the
    study is over when this reaches ``trials``."""
    return len(counted_trials(study))


def count_completed(study) -> int:
    """How many trials completed (a finite objective value): the only ones that count as
    results (a study whose every trial failed has 0)."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def completed_and_failed(study, trials: list | None = None) -> tuple[int, int]:
    """``(completed, failed)`` trials, both counted from one snapshot of the study's trials:
    counted in two queries, a trial another worker completed between them was shown "failed"."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False) if trials is None else trials
    completed = sum(t.state == TrialState.COMPLETE for t in trials)
    return completed, len(counted_trials(study, trials)) - completed


def study_summary(study) -> dict[str, Any]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    states = {s.name: 0 for s in TrialState}
    for t in trials:
        states[t.state.name] += 1
    interrupted = len(interrupted_numbers(trials))
    completed, failed = completed_and_failed(study, trials)
    # "finished" counts COMPLETE trials only: a failed trial is no result
    return {"finished": completed, "failed": failed, "states": states, "interrupted": interrupted}


def fail_running_trials(study) -> int:
    """Mark every RUNNING trial interrupted and re-enqueue it (only when no other worker is alive)."""
    import optuna
    from optuna.trial import TrialState

    callback = _RetryInterrupted()
    with storage_lock(study._storage):
        return _fail_running(study, callback, optuna, TrialState)


def _fail_running(study, callback, optuna, TrialState) -> int:
    n = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        try:
            changed = study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # finished meanwhile
            continue
        if changed:
            callback(study, study._storage.get_trial(trial._trial_id))
            n += 1
    return n


def claim_waiting_trial(study, sampler_factory: Callable[[int], Any] | None = None):
    """Atomically take one WAITING trial (-> RUNNING) and return it as an ``optuna.Trial``, or None.

    ``sampler_factory(trial_number)`` gives the sampler of that trial: seeding it per trial
    number keeps a single worker reproducible and lets parallel workers (which would otherwise
    share one seed and draw the same random start-up points) explore different points.

    WAITING trials are taken in the order of the slot they fill (:func:`slot_order`): the retry
    of an interrupted trial comes before the slots after it, so a single worker's resumed search
    samples what the uninterrupted one did (run last, the later slots' TPE saw one finished
    trial fewer and sampled other points).
    """
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    with storage_lock(storage):
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        for frozen in sorted(waiting, key=slot_order):
            try:
                if storage.set_trial_state_values(frozen._trial_id, state=TrialState.RUNNING):
                    break
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
        else:
            return None
    if sampler_factory is not None:
        study.sampler = sampler_factory(frozen.number)
    return optuna.Trial(study, frozen._trial_id)


def slot_order(trial) -> tuple[int, int]:
    """``(number of the first attempt, number)``: a retry (Optuna's ``failed_trial`` system
    attribute, the interrupted trial's number) sorts where its original trial was."""
    return int(trial.system_attrs.get("failed_trial", trial.number)), int(trial.number)


@contextlib.contextmanager
def storage_lock(storage) -> Iterator[None]:
    """Serialise trial-state changes between processes sharing a SQLite file.

    Optuna's compare-and-set of a trial's state (WAITING -> RUNNING) reads with
    ``SELECT ... FOR UPDATE``: a row lock on PostgreSQL/MySQL, but nothing on SQLite, where two
    processes can both claim one trial. For a SQLite storage (always a local file) an exclusive
    ``fcntl`` lock beside the database file closes that race; other databases need none.
    """
    with _sqlite_file_lock(_storage_url(storage)):
        yield


def _storage_url(storage) -> str:
    """The database URL of an Optuna storage, looking through Optuna's cache layer.

    ``study._storage`` of an RDB study is a ``_CachedStorage`` wrapping the ``RDBStorage``
    (``_backend``); only the latter has the ``url``. (Reading the wrapper alone gave "" and
    silently turned the SQLite lock off: two workers could claim the same trial.)
    """
    url = _storage_attr(storage, "url")
    return str(url) if url else ""


def _storage_attr(storage, name: str) -> Any:
    """Attribute ``name`` of an Optuna storage or of the storage it wraps (``_backend``), or None."""
    while storage is not None:
        value = getattr(storage, name, None)
        if value:
            return value
        storage = getattr(storage, "_backend", None)
    return None


@contextlib.contextmanager
def _sqlite_file_lock(url: str) -> Iterator[None]:
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        yield
        return
    import fcntl

    lock_path = Path(url[len("sqlite:///"):]).with_suffix(".lock")
    with open_appending(lock_path) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _heartbeat(storage, trial_id: int, interval: float) -> Iterator[None]:
    """Record the trial's heartbeat now, then every ``interval`` seconds on a thread.

    The first beat is written before the objective starts: Optuna only declares a RUNNING
    trial stale once it has a heartbeat, so a worker killed before its beat thread got to run
    (seen under CI load) would otherwise leave a trial RUNNING that no worker ever retries.
    """
    stop = threading.Event()
    with contextlib.suppress(Exception):
        storage.record_heartbeat(trial_id)

    def beat() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)

    thread = threading.Thread(target=beat, name=f"dmlkit-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def run_worker(
    study,
    objective: Callable[[Any], float],
    *,
    heartbeat_interval: float = 30.0,
    max_trials: int | None = None,
    on_trial_end: Callable[[Any], None] | None = None,
    sampler_factory: Callable[[int], Any] | None = None,
) -> int:
    """Claim and run WAITING trials until none is left (or ``max_trials``); returns how many ran.

    ``objective(trial) -> float`` is maximised. An exception marks the trial FAIL (its message
    in the ``error`` user attribute) and the loop goes on; a non-finite value is a FAIL too.
    ``KeyboardInterrupt``/``SystemExit`` propagate, leaving the trial RUNNING for the retry logic.
    """
    import math

    import optuna
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    ran = 0
    while max_trials is None or ran < max_trials:
        with warnings.catch_warnings(), storage_lock(study._storage):
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_stale_trials(study)
        trial = claim_waiting_trial(study, sampler_factory)
        if trial is None:
            break
        state, value = TrialState.FAIL, None
        with _heartbeat(study._storage, trial._trial_id, heartbeat_interval):
            try:
                value = float(objective(trial))
                if math.isfinite(value):
                    state = TrialState.COMPLETE
                else:
                    trial.set_user_attr("error", f"objective is not finite ({value})")
            except optuna.TrialPruned:
                state = TrialState.PRUNED
            except Exception as exc:  # a failed trial is recorded; the study goes on
                with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                    trial.set_user_attr("error", f"{exc.__class__.__name__}: {exc}")
                    trial.set_user_attr("traceback", traceback.format_exc(limit=20)[-4000:])
        try:
            if state == TrialState.COMPLETE:
                frozen = study.tell(trial, value)
            else:
                frozen = study.tell(trial, state=state)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            # finished meanwhile by another process (it was declared stale): theirs counts
            ran += 1
            continue
        ran += 1
        if on_trial_end is not None:
            on_trial_end(frozen)
    return ran
