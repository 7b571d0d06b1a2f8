"""A request's prompt as the engine will see it: not a policy, but what several users
(`kv_aware`'s token ids, and any path that must send token ids) need alike.

- `chat_template`: a chat, Responses or Anthropic Messages body rendered with the model's
  chat template exactly as vLLM renders it (`chat_request`, `chat_messages`,
  `chat_from_messages`, `chat_from_responses` read the bodies; `chat_content_format`
  decides how content parts reach the template; `chat_sandbox` bounds the template's
  work; `chat_model_dir` reads the model's directory);
- `tokenizer`: the model's tokenizer, encoding as the engines encode;
- `detokenize`: the text of generated ids, made as an engine streams it (stop strings and
  what they hold back included), for the text of a resumed stream after its seam.
"""
