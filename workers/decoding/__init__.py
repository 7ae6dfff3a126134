"""The decoding algorithms: generation loop pieces, sampling, the DDTree tree, drafting, and one module per method."""
