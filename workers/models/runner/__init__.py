"""The target runner (``target.StaticTarget``, ``target.make_target``): the layer loop, the sequence's
static buffers and the CUDA graphs of each forward kind, one module each (``limits`` holds the sizes
planning reads without importing the runner)."""
