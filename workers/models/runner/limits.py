"""What the runner keeps, for planning that must not import it (``workers.models.placement``)."""

MAX_VERIFY_GRAPHS = 4  # verify widths kept captured (a trial uses 1 for AR, n+1, or B+1)
