"""Report sections: one module per part of the paper, each with TITLE, ORDER and build(ctx)."""
