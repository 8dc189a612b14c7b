"""Flags that commands of several layers share (the ``pdd`` command line is assembled from
``infra`` and from what ``loadtest`` registers; both take these from here)."""

import argparse

RUN_DIR_HELP = "the deployment's run folder (default: ~/.cache/pdd/run)"


def add_model_args(parser: argparse.ArgumentParser):
    """``--model``, ``--device`` and ``--dtype`` of a command that loads the model."""
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (default), tiny (random test model) or an HF model folder"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV dtype"
    )
