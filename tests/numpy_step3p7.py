"""Independent float64 numpy reference for Step-3.7-Flash (``step3p7``): Step-3.5's
text model and MTP layers (`numpy_step3p5`) read from ``text_config``; the vision
tensors take no part in text decoding."""

from . import numpy_step3p5
from .numpy_reference import load_checkpoint


def reference_logits(ckpt_dir, tokens):
    """`numpy_reference.reference_logits` for a Step-3.7 checkpoint."""
    config, W = load_checkpoint(ckpt_dir)
    cfg = config["text_config"]
    head = W["lm_head.weight"]
    hidden = numpy_step3p5.trunk_hidden(W, cfg, tokens)
    n, main, mtp = len(tokens), hidden @ head.T, []
    for j in range(numpy_step3p5.num_mtp_layers(W, cfg)):
        rows = n - 1 - j
        hidden = numpy_step3p5.mtp_layer(
            W, cfg, "step3p5", j, hidden[:rows], tokens[j + 1 :]
        )
        mtp.append(hidden @ head.T)
    return main, mtp
