"""Checks every image-reading family's tests share."""

from mlx_mtp.generate import batch_generate


def assert_rows_mix_text_and_images(model, tokenizer, pictures, chat, ours, n, **kw):
    """Four prompts (three with an image, one text only) batched together at k = 2
    and auto (``kw``: more `batch_generate` options) give each its lone plain run;
    ``chat(tokenizer, text, images)`` writes a prompt, ``ours(model, tokenizer,
    prompt, images, **options)`` decodes one alone (tokens first), ``n`` tokens."""
    prompts = [
        chat(tokenizer, "Transcribe.", 1),
        chat(tokenizer, "Tell me a story about a fox.", 0),
        chat(tokenizer, "What colour is this?", 1),
        chat(tokenizer, "Transcribe.", 1),
    ]
    images = [[pictures[0]], None, [pictures[1]], [pictures[0]]]
    alone = [
        ours(model, tokenizer, p, im, num_draft_tokens=0)[0]
        for p, im in zip(prompts, images)
    ]
    for k in (2, "auto"):
        batch = batch_generate(
            model,
            tokenizer,
            prompts,
            max_tokens=n,
            images=images,
            num_draft_tokens=k,
            max_batch=3,
            **kw,
        )
        assert batch.token_ids == alone, k
    assert alone[0] != alone[2]  # the images, not only the text, decide
