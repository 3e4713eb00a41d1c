"""Model families: the registry, and what the rest of mtjax asks of a model.

A family (one module here each; README's family table lists them) is registered under the
`architectures` names of Hugging Face's config.json. It declares how its config.json reads into a
`ModelConfig` and back, where each Hugging Face tensor sits in mtjax's parameters, the packed forms
of weights it decodes and the tensors it tolerates. What the layers compute is the config's
business (mtjax.models.layers): the store, engine, planner, checkpoints and export ask `spec(cfg)`
for the layer kinds and their order, the flat layouts, parameter counts (total and active per
token), FLOPs and the auxiliary loss, and never branch on a family's name.
"""

from mtjax.models.layers import BlockKind
from mtjax.models.registry import (Decoder, Family, FamilyError, Piece, Stored, block_index,
                                   families, for_architecture, get, group_names, read_hf_config,
                                   register)
from mtjax.models.spec import ModelSpec, spec

__all__ = ["BlockKind", "Decoder", "Family", "FamilyError", "ModelSpec", "Piece", "Stored",
           "block_index", "families", "for_architecture", "get", "group_names", "read_hf_config",
           "register", "spec"]
