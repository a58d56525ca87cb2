"""LR-AttnRes replication: model, routing, data, training and the stages of the pipeline."""

__version__ = "0.1.0"
