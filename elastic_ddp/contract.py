"""What crosses a process boundary: the names and values one kind of process sets and another reads.

The kinds: the user's shell (and deploy/'s scripts), the torchrun agent with this package's
rendezvous handler (``rendezvous/``, ``prestart/__init__.py``, ``agent_marks.py``), the node's
warm-start template and each worker's relay (``prestart/template.py`` and
``prestart/shim/sitecustomize.py``), and the training worker (``worker/`` and what it imports).
Each name is defined here once; every module that writes or reads it imports it from here.

Standard library only, and no import of this package: the template and the relay load this file by
its path (as they load ``prestart/wire.py``) before anything else is imported, so that a worker that
starts as usual pays for nothing.
"""

__all__ = [
    "AGENT_DIR_PREFIX", "ENV_AGENT_PID", "ENV_CHECKPOINT_KEY", "ENV_ETCD_BINARY", "ENV_ETCD_PASSWORD", "ENV_FAULT",
    "ENV_LOG_LEVEL", "ENV_PREFIX", "ENV_PRESTART", "ENV_PRESTART_PID", "ENV_PRESTART_SOCKET", "ENV_RDZV_ROUND",
    "ENV_SETTINGS_ERROR_DIR", "ENV_TORCH_ETCD", "EXIT_CONFIG", "EXIT_FAILED", "EXIT_NOT_RESTARTED", "EXIT_ORPHANED",
    "EXIT_STOPPED", "EXIT_STOP_TIMEOUT", "LEAVING_SOCKET", "MAX_LEAVING_MESSAGE", "MEMBERS_GONE_FILE",
    "NODES_JOINING_FILE", "OWNER_FILE", "PRESTART_SOCKET", "SETTINGS_ERROR_FILE", "TEMPLATE_PROCESS_NAME",
    "WARM_SUFFIX", "WORKER_PROCESS_NAME_PREFIX",
]  # fmt: skip

# Every environment variable of this package starts with this. The template forks a worker whose
# values of these differ from its own: the package reads them as it runs, not as it is imported.
ENV_PREFIX = "ELASTIC_DDP_"

# --- Set by the agent's rendezvous handler, inherited by the workers torchrun starts -------------

# The agent's directory (rendezvous/agent_dir.py), where its workers reach it: the files and sockets
# below. Read by the worker (worker/stop.py: settings errors, the stop marks, the leaving socket).
ENV_SETTINGS_ERROR_DIR = "ELASTIC_DDP_SETTINGS_ERROR_DIR"
# The agent's pid. Read by the worker (worker/stop.py) and the relay (the shim): only the agent's own
# workers use its directory and its template, not a process that merely inherited the variables.
ENV_AGENT_PID = "ELASTIC_DDP_AGENT_PID"
# The number of the rendezvous round the workers were started in. Read by the worker
# (worker/distributed.py: the attempt's id, the ready line).
ENV_RDZV_ROUND = "ELASTIC_DDP_RDZV_ROUND"
# The template's socket (set by prestart.Template.environment). Read by the relay (the shim), which
# asks the template there for a warm copy; the template leaves it out of the environment it compares.
ENV_PRESTART_SOCKET = "ELASTIC_DDP_PRESTART_SOCKET"
# The template's pid (set beside the socket). Read by the relay: it waits for a template still
# importing torch while that pid lives.
ENV_PRESTART_PID = "ELASTIC_DDP_PRESTART_PID"

# --- Set by the user (shell, deploy/ manifests, tests) -------------------------------------------

# "0" turns warm starts off. Read by the agent's node services (rendezvous/node.py).
ENV_PRESTART = "ELASTIC_DDP_PRESTART"
# The key that signs checkpoint manifests and compile caches. Read by the worker
# (checkpoint/manifest.py, checkpoint/compiled.py; config/sections.py names it in its advice).
ENV_CHECKPOINT_KEY = "ELASTIC_DDP_CHECKPOINT_KEY"
# The etcd password (with rdzv_conf ``user``), never taken from rdzv_conf, which ``ps`` shows. Read
# by the agent (rendezvous/plugin.py).
ENV_ETCD_PASSWORD = "ELASTIC_DDP_ETCD_PASSWORD"
# "1": ``--rdzv-backend=etcd`` stays torch's legacy v2 handler. Read by the agent (rendezvous/plugin.py).
ENV_TORCH_ETCD = "ELASTIC_DDP_TORCH_ETCD"
# The etcd executable to run. Read by ``elastic-ddp etcd`` and the tests (tools/etcd_server.py).
ENV_ETCD_BINARY = "ELASTIC_DDP_ETCD_BINARY"
# The logging level. Read by every process of the package that logs: agent and worker (logs.py).
ENV_LOG_LEVEL = "ELASTIC_DDP_LOG_LEVEL"
# Failures injected by the tests. Read by the worker (faults.py; grammar there).
ENV_FAULT = "ELASTIC_DDP_FAULT"

# --- Files and sockets in the agent's directory ---------------------------------------------------

# The directories' name prefix, in the temp directory. Written by each agent; read by later agents,
# which remove the directories of agents that are gone (rendezvous/agent_dir.py).
AGENT_DIR_PREFIX = "elastic_ddp-agent-"
# Its owner mark: the agent's host, PID namespace, pid and start time. Written by the agent that made
# the directory, read by later agents' clean-up (rendezvous/agent_dir.py).
OWNER_FILE = "owner"
# A worker's invalid settings. Written by the worker (agent_marks.report_settings_error), read by the agent,
# which then ends the job on every node (rendezvous/node.py reads it, rendezvous/handler.py ends the job).
SETTINGS_ERROR_FILE = "settings-error.txt"
# Why the agent is about to stop its workers: nodes of their round are gone, or (all stay) only to
# admit a joining node. Written by the agent before its signal, read by the worker (worker/stop.py: StopSignal).
MEMBERS_GONE_FILE = "members-gone.txt"
NODES_JOINING_FILE = "nodes-joining.txt"
# A Unix datagram socket: a worker says its node leaves the job, its stop checkpoint committed.
# Bound by the agent (rendezvous/leaving.py), sent to by the worker (agent_marks.report_leaving); a message
# is at most MAX_LEAVING_MESSAGE bytes on both sides.
LEAVING_SOCKET = "leaving.sock"
MAX_LEAVING_MESSAGE = 4096
# The template's listening socket. Bound by the template (through a staging name,
# ``prestart.sock.<pid>``), its path exported by the agent (ENV_PRESTART_SOCKET), connected to by the
# relay (the shim).
PRESTART_SOCKET = "prestart.sock"
# An empty file beside the template's socket: written by the successor once every preload is imported,
# waited for by the agent (prestart.Template.warm_up).
WARM_SUFFIX = ".warm"

# --- What ``ps`` shows (user's shell tools, the tests' process watchers) ---------------------------

# The template and its successor. Set by the template (prctl PR_SET_NAME, 15 bytes at most).
TEMPLATE_PROCESS_NAME = "edp-template"
# A worker forked from the template, followed by its rank. Set by the forked copy.
WORKER_PROCESS_NAME_PREFIX = "edp-rank"

# --- Worker exit statuses: set by the worker, read by torchrun's agent (any status but 0 restarts its
# workers, while restarts last), by the relay (which passes the status on) and by users' scripts ---

# A failure the job cannot recover from by itself (a checkpoint that cannot be written, storage that
# is not shared, a resume that would mix runs): one clear message, then this status.
EXIT_FAILED = 1
# A setting is invalid (an unknown key, a value out of range), found before any process group exists:
# no restart can fix it. 2, the status of a command-line usage error (argparse's): scripts and tests
# check it. Under this package's rendezvous handler the agent ends the job on every node at once.
EXIT_CONFIG = 2
# A worker whose agent vanished (the node was lost): it must not train on as a ghost of the old group,
# so it leaves on its own. The relay exits with it too when the template (and so its copy) is gone.
EXIT_ORPHANED = 70
# After a stop on request with the checkpoint committed (EX_TEMPFAIL: run again to resume). Non-zero
# on purpose: a worker stopped by someone other than its agent is restarted.
EXIT_STOPPED = 75
# The stop did not reach a step boundary (and its checkpoint) within checkpoint.grace_s.
EXIT_STOP_TIMEOUT = 76
# A survivor waited dist.restart_wait_s after a stop checkpoint without being restarted.
EXIT_NOT_RESTARTED = 77
