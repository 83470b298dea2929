"""Defaults and limits shared by the library and the CLI (this module imports
nothing, so the CLI reads them before MLX is loaded)."""

DEFAULT_MAX_DRAFT_TOKENS = 4  # the largest k "auto" picks unless told otherwise
MAX_DRAFT_TOKENS = 16  # drafts per round at most; far past any break-even acceptance
MAX_PROBE_INTERVAL = 256  # rounds between probes, at most, while drafting is off
DEFAULT_LOOKUP_TOKENS = 8  # the longest draft found in the context (prompt lookup)
SINK_TOKENS = 4  # first positions mlx-lm's rotating cache (max_kv_size) always keeps
MIN_KV_SIZE = SINK_TOKENS + 1  # the smallest max_kv_size: the sinks and one more
SERVER_MAX_TOKENS = 512  # a server reply's tokens when the request does not say
DEFAULT_MAX_BATCH = 8  # streams decoded together at most (server and batch API)
