"""Pure caching logic: no ComfyUI import here, only torch and the standard library."""
