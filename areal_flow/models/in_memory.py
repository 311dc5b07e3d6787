"""A loaded model's parameters in the process's own memory, out of its checkpoint file's mapping.

``from_pretrained`` maps a safetensors file copy-on-write, and a parameter loaded in the file's
dtype stays in that mapping, so the first write to each page (a trainer's first optimizer step,
a generation engine's first weight update) copies the page then: inside the RL loop, from every
thread of the kernel at once. SmolLM2-135M's 538 MB took 139,000 faults on its first write; on
the development VM the chat job's first AdamW step took 6.6 s and the generator's first weight
load 5.8 s against 0.1 s and 0.4 s later (docs/PERFORMANCE.md, weights out of the file's
mapping). A model that is only read (a reference policy) is better left mapped: it shares the
page cache.
"""

from __future__ import annotations

import torch


def copy_out_of_file(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every parameter's data of ``model`` by a copy in this process's memory; return
    ``model``. Each ``Parameter`` is visited once (``Module.parameters`` deduplicates), so tied
    parameters (an embedding and its LM head) stay one object, copied once."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model
