"""Chat SFT: the tokenizer's own chat template, rendered and tokenized, with an assistant loss mask."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# tokenizer_config.json fields a template may read, as transformers passes them (special_tokens_map)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


class _Generation(jinja2.ext.Extension):
  """transformers' `{% generation %}...{% endgeneration %}` tags: renders the body as is and, while
  ChatTemplate tracks a rendering, records the character span the body fills."""
  tags = {"generation"}

  def __init__(self, environment):
    super().__init__(environment)
    self.tracking = None  # [characters rendered so far, spans] while a rendering is tracked

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    text = caller()
    if self.tracking is not None:
      start = self.tracking[0]
      self.tracking[1].append((start, start + len(text)))
    return text


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' tojson: jinja's own escapes HTML characters, which would change the rendered text
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def token_text(value: Any) -> str | None:
  """A special token from tokenizer_config.json: a string or an AddedToken dict with `content`."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def tokenizer_files(path: str | Path) -> tuple[Path, Path | None]:
  """(tokenizer.json, tokenizer_config.json or None) for a directory or a tokenizer.json path."""
  path = Path(path)
  if path.is_dir():
    tok = path / "tokenizer.json"
  else:
    tok = path
  if not tok.is_file():
    raise FileNotFoundError(f"--tokenizer: {tok} does not exist")
  cfg = tok.parent / "tokenizer_config.json"
  return tok, cfg if cfg.is_file() else None


def load_tokenizer_config(path: str | Path) -> dict:
  """The tokenizer_config.json beside the tokenizer at `path`, or {} when there is none."""
  _, cfg = tokenizer_files(path)
  if cfg is None:
    return {}
  try:
    return json.loads(cfg.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{cfg}: not a readable JSON file ({e})") from None


# The roles a conversation may hold: the ones chat templates know. Anything else is a typo or a
# format the template would render wrongly or not at all.
ROLES = ("system", "user", "assistant", "tool")


def problem(messages: list[dict]) -> tuple[str, int, str] | None:
  """(reason, index, message) of the first message with an unknown role or an empty assistant
  turn, or of a conversation without an assistant message; None when it is one to train on."""
  for k, m in enumerate(messages):
    if m.get("role") not in ROLES:
      return "unknown role", k, (f"messages[{k}] has unknown role {m.get('role')!r} (not one of "
                              f"{', '.join(ROLES)})")
    if m["role"] == "assistant" and not text_of(m.get("content")).strip():
      return "empty assistant turn", k, (f"messages[{k}] is an empty assistant message: nothing to "
                                      "train on")
  if not any(m["role"] == "assistant" for m in messages):
    return "no assistant turn", len(messages), "conversation has no assistant message to train on"
  return None


def text_of(content) -> str:
  """A message's text: its content, or the text of its parts ([{"type": "text", "text"}, ...])."""
  if isinstance(content, list):
    return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
  return str(content or "")


def as_parts(messages: list[dict]) -> list[dict]:
  """The messages with every string content as one text part, as processors' templates take them."""
  return [{**m, "content": [{"type": "text", "text": m["content"]}]}
          if isinstance(m.get("content"), str) else m for m in messages]


def check_messages(messages: list[dict]) -> None:
  """Raises ValueError naming the first problem `problem` finds."""
  found = problem(messages)
  if found:
    raise ValueError(found[2])


class ChatTemplate:
  """A tokenizer's chat template, rendered as transformers' `apply_chat_template` renders it.

  mask_method says how assistant_spans finds the assistant tokens: "generation_tags" when the
  template marks them with `{% generation %}` tags, else "render_diff".
  """

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
      ast = env.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
    self.template = env.from_string(ast)
    self._generation = env.extensions[_Generation.identifier]
    tagged = any(isinstance(n.call, jinja2.nodes.Call)
                 and isinstance(n.call.node, jinja2.nodes.ExtensionAttribute)
                 and n.call.node.identifier == _Generation.identifier
                 for n in ast.find_all(jinja2.nodes.CallBlock))
    self.mask_method = "generation_tags" if tagged else "render_diff"
    self.special_tokens = dict(special_tokens or {})

  @classmethod
  def from_tokenizer(cls, path: str | Path) -> "ChatTemplate":
    """Reads `chat_template` of tokenizer_config.json (or chat_template.jinja) by the tokenizer.

    Args:
      path: a directory holding tokenizer.json, or the tokenizer.json file.

    Returns:
      The template with the config's special tokens (bos_token, eos_token, ...) as variables.
    """
    tok, cfg_path = tokenizer_files(path)
    cfg = load_tokenizer_config(path)
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    jinja_file = tok.parent / "chat_template.jinja"
    if not source and jinja_file.is_file():
      source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
      raise ValueError(f"{cfg_path or tok.parent}: no chat_template (nor {jinja_file.name}) "
                       "for the chat format")
    special = {k: token_text(cfg.get(k)) for k in _SPECIAL_TOKENS}
    return cls(source, {k: v for k, v in special.items() if v is not None})

  def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text; any failure of the template becomes a one-line ValueError."""
    return self._generate(messages, add_generation_prompt)

  def _generate(self, messages: list[dict], add_generation_prompt: bool,
                tracking: list | None = None) -> str:
    # With `tracking` ([0, []]), the generation tags record where their text starts from the count
    # of characters yielded so far, as transformers does: a generator yields each piece before it
    # renders the next.
    parts = []
    self._generation.tracking = tracking
    try:
      for chunk in self.template.generate(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt,
                                          **self.special_tokens):
        parts.append(chunk)
        if tracking is not None:
          tracking[0] += len(chunk)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"chat template: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
      # the template is code from the model's files: its bugs are an input error, not ours
      raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
      self._generation.tracking = None
    return "".join(parts)

  def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Renders `messages` and returns the text with the character spans of the assistant turns.

    With generation tags (mask_method "generation_tags"), the spans are the characters rendered
    inside the tags, as transformers' `return_assistant_tokens_mask` takes them. Otherwise
    ("render_diff"), the span of each assistant message runs from the end of the prompt the template
    renders before it (its header, as `add_generation_prompt` renders it) to the end of its turn:
    the text the model must generate, end-of-turn token included, trailing whitespace dropped. The
    spans are positions in the rendering of the whole conversation, also when the template renders
    a turn there otherwise than as the last message (it drops earlier turns' reasoning, or moves
    the system message), and a message the whole rendering leaves out has none.

    Raises:
      ValueError: the template fails, or the rendering holds no assistant text at all.
    """
    if self.mask_method == "generation_tags":
      text, spans = self._tagged_spans(messages)
      if not any(b > a for a, b in spans):
        raise ValueError("chat template: its {% generation %} tags mark nothing in this "
                         "conversation")
      return text, spans
    text = self.render(messages)
    spans = []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant":
        continue
      span = self._turn_span(messages, i, text)
      if span is None:
        continue
      if spans and span[0] < spans[-1][1]:
        raise ValueError(f"chat template: cannot locate assistant message {i} in the rendering "
                         "(it overlaps the previous one)")
      spans.append(span)
    if not spans:
      raise ValueError("chat template: the rendering holds none of the assistant messages")
    return text, spans

  def _tagged_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    tracking = [0, []]
    text = self._generate(messages, False, tracking)
    return text, tracking[1]

  def _turn_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int] | None:
    """The span of assistant message i in `full`, the rendering of `messages`; None if absent."""
    before = self.render(messages[:i], add_generation_prompt=True)
    through = self.render(messages[:i + 1])
    eos = self.special_tokens.get("eos_token")
    end = len(through.rstrip())
    tail = through[len(before):end]
    if (through.startswith(before) and full.startswith(through)
        and not (eos and eos in tail and tail[tail.rfind(eos) + len(eos):].strip())):
      # The template renders a prefix of the conversation as a prefix of the whole: the message's
      # turn is what the cut after it adds to the cut before it (up to an EOS: templates that
      # render more after it, a new generation prompt, take the way below).
      return (len(before), end) if end > len(before) else None
    # The template renders the cuts otherwise than the whole (it rewrites earlier turns or moves
    # text by position). The message's content is found in the whole rendering by rendering it
    # again with the content replaced by a character none of these renderings holds: the two
    # differ exactly where the template puts the content.
    probe = _probe(full, before, through)
    parts = isinstance(messages[i].get("content"), list)  # a processor's template: text parts
    probed = dict(messages[i], content=[{"type": "text", "text": probe}] if parts else probe)
    alt = self.render(messages[:i] + [probed] + messages[i + 1:])
    if alt == full:
      return None  # the whole rendering leaves the message out: nothing of it to train on
    c0 = _common_prefix(full, alt)
    c1 = len(full) - _common_suffix(full, alt, c0)
    # The start: the end of the prompt before the message, as the generation prompt renders it.
    # Where the whole rendering holds that prompt otherwise (a system message it moves), the end is
    # where the whole rendering's text before the content ends with most of the prompt's last
    # characters (the header and the user message before it).
    if full.startswith(before):
      start = len(before)
    else:
      start = _aligned_end(before, full, _common_prefix(before, full), c0)
    start = min(start, c0)
    # The end: what the template renders after the content when the message is the last one (its
    # end of turn, up to an EOS), as far as the whole rendering holds it after the content, in
    # whole pieces: where the two differ inside a marker ("<|end|>\n<|user|>" against
    # "<|end|>\n</s>"), the marker belongs to what follows.
    cut_alt = self.render(messages[:i] + [probed])
    closing = through[len(through) - _common_suffix(through, cut_alt,
                                                    _common_prefix(through, cut_alt)):]
    if eos and eos in closing:
      closing = closing[:closing.index(eos) + len(eos)]
    n = _whole_pieces(closing, _common_prefix(full[c1:c1 + len(closing)], closing))
    end = c1 + len(closing[:n].rstrip())
    return (start, end) if end > start else None


def _common_prefix(a: str, b: str) -> int:
  """The length of the longest common prefix of a and b."""
  return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str, keep: int = 0) -> int:
  """The length of the longest common suffix of a[keep:] and b[keep:]."""
  a, b = a[keep:], b[keep:]
  n = 0
  while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
    n += 1
  return n


def _aligned_end(a: str, b: str, lo: int, hi: int) -> int:
  """The position j in [lo, hi] at which b[:j] ends with the longest suffix of a (the last of
  equals, as near as can be to hi); hi where no position matches a character."""
  best, at = 0, hi
  for j in range(hi, lo - 1, -1):
    n = 0
    while n < min(len(a), j) and a[-1 - n] == b[j - 1 - n]:
      n += 1
    if n > best:
      best, at = n, j
  return at


# The pieces a template's text is made of, for cutting a partial match at a whole one: whitespace
# runs, <tags>, [TAGS] and runs of other characters.
_PIECES = re.compile(r"\s+|<[^<>\s]*>|\[[^\[\]\s]*\]|[^\s<\[]+|.", re.S)


def _whole_pieces(text: str, n: int) -> int:
  """The length of the longest prefix of text[:n] that ends where a piece of text ends."""
  end = 0
  for m in _PIECES.finditer(text):
    if m.end() > n:
      break
    end = m.end()
  return end


def _probe(*texts: str) -> str:
  """A character none of `texts` holds, from Unicode's private use area."""
  for code in range(0xE000, 0xF900):
    if not any(chr(code) in t for t in texts):
      return chr(code)
  raise ValueError("chat template: the rendering holds every private-use character")


def loss_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """1 on every token whose characters overlap an assistant span (as transformers' assistant_masks).

  Args:
    offsets: each token's (start, end) character offsets in the rendered text.
    spans: sorted, disjoint (start, end) character spans of the assistant messages.

  Returns:
    [n_tokens] uint8 mask.
  """
  mask = np.zeros(len(offsets), np.uint8)
  k = 0
  for t, (a, b) in enumerate(offsets):
    while k < len(spans) and a >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if b > spans[k][0]:  # byte-level BPE trims whitespace tokens to empty spans: count them
      mask[t] = 1
  return mask


def encode_chat(tokenizer, template: ChatTemplate, messages: list[dict],
                last_turn_only: bool = False, expand=None) -> tuple[np.ndarray, np.ndarray]:
  """Tokenizes a conversation as `apply_chat_template(messages, tokenize=True)` does.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    template: the tokenizer's chat template; its mask_method says how the mask was found.
    messages: [{"role": ..., "content": ...}, ...], roles from ROLES, no empty assistant message.
    last_turn_only: the mask covers the last assistant turn the rendering holds, not every one.
    expand: (text, spans) -> (text, spans), applied to the rendering before it is tokenized (a
      processor's image placeholders replaced by the image tokens: ImageProcessor.expand).

  Returns:
    (ids [n] int64, loss mask [n] uint8: 1 on the assistant messages' tokens).
  """
  check_messages(messages)
  text, spans = template.assistant_spans(messages)
  if last_turn_only:
    spans = [s for s in spans if s[1] > s[0]][-1:]
  if expand is not None:
    text, spans = expand(text, spans)
  enc = tokenizer.encode(text, add_special_tokens=False)
  return np.asarray(enc.ids, np.int64), loss_mask(enc.offsets, spans)
