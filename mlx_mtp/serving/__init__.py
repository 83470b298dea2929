"""The parts of `mlx-mtp serve` (`mlx_mtp.server` puts them together), one job each:

- `sessions`: the conversations kept for prompt reuse (`Sessions`);
- `provider`: the one served model, loaded with `mlx_mtp.load`, and its round
  costs measured before serving (`MTPModelProvider`);
- `jobs`: a request as the server keeps it from its checks to the end of its
  reply (`Job`, its queue `Responses`, `Replies`), and its failures as replies;
- `budget`: the cache memory a batch takes (`CacheCost`) and the default bound;
- `scheduler`: the batched decoding of the generation loop (`Scheduler`);
- `generator`: the generation thread (`MTPResponseGenerator`), batched or one
  request at a time;
- `http_guard`: bounds on connections, time and bodies, and the API keys;
- `handler`: a request's HTTP side (`MTPHandler`): checks, decode options,
  errors in OpenAI's or Anthropic's form, the ``mtp`` block.
"""
