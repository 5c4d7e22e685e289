"""transformers' ``padding_idx`` on the input embedding, as an option (``drop_pad_embedding_grad: true``).

transformers builds its input embedding as ``nn.Embedding(..., padding_idx=pad_token_id)``, whose backward
drops the gradient of the pad token's row from every position where that token is an *input*. Where the pad
token is also a real token (SmolLM2's pad is ``<|im_end|>``, in every chat prompt and the stop token), that
changes training: TRL (and anything built on ``from_pretrained``) never trains that row as an input, while
this recipe's torchtune embedding gets the exact gradient. See docs/algorithms.md, "Where this recipe and
TRL differ on identical inputs".
"""

from torch import nn


def drop_pad_input_embedding_grad(model: nn.Module, pad_id: int) -> nn.Embedding:
    """Set ``padding_idx = pad_id`` on the model's input embedding, as transformers builds it.

    The weights are not touched (``nn.Embedding`` zeroes the row only when *built* with a ``padding_idx``);
    only the backward changes. With tied embeddings the row still gets its gradient as the output weight of
    the pad token.

    Args:
        model (nn.Module): a torchtune decoder (``tok_embeddings`` an ``nn.Embedding``), plain or FSDP2-wrapped.
        pad_id (int): the tokenizer's pad token id.

    Returns:
        nn.Embedding: the embedding changed.

    Raises:
        ValueError: the model has no ``tok_embeddings`` embedding, or ``pad_id`` is not one of its rows.
    """
    embedding = getattr(model, "tok_embeddings", None)
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(
            "drop_pad_embedding_grad: true needs a torchtune decoder whose `tok_embeddings` is an nn.Embedding; "
            f"{type(model).__name__}.tok_embeddings is {type(embedding).__name__}"
        )
    if not 0 <= pad_id < embedding.num_embeddings:
        raise ValueError(
            f"drop_pad_embedding_grad: true, but the tokenizer's pad id {pad_id} is not a row of the model's "
            f"embedding (vocabulary {embedding.num_embeddings})"
        )
    embedding.padding_idx = pad_id
    return embedding
