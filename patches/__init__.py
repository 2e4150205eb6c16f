"""Everything that touches ComfyUI internals. Each patch has one install and one uninstall,
idempotent, guarded by feature probes."""
