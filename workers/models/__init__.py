"""Where models come from and how the target runs: loading, placement, shapes, the drafter, the
static target (``runner``) and its layers."""
