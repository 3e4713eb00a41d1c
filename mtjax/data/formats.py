"""Dataset formats: a row of an input file as a document to tokenize.

A document is a string (text), a list of chat messages ({"role", "content"}, rendered through the
model's chat template) or a Pair (a prompt conversation with a chosen and a rejected answer). The
formats and the columns they read (each renamed with `--columns FIELD=COLUMN`):

  text               text
  alpaca             instruction, input (optional), output, system (optional), history (optional
                     [[query, answer], ...] turns before the instruction)
  sharegpt           conversations: [{"from": ..., "value": ...}] with human/gpt/system/tool
                     (observation, function_call) roles; system (optional); the message keys are
                     the fields role and content (`--columns role=from,content=value` by default)
  messages           messages: [{"role": ..., "content": ...}]; a content may be a list of parts,
                     {"type": "text", "text"} and {"type": "image", "image" (or "path", "url")}
  prompt_completion  prompt, completion (or response), system (optional)
  preference         prompt (a string or messages; or messages), chosen, rejected (each a string or
                     a conversation whose last message is the answer), system (optional)

`chat` (messages, else prompt and response, per row) and `jsonl` (text) are the older names.

Images (sharegpt and messages): image parts in a message's content, or an `images` column (a list
of paths, bytes or `datasets` Image values {"bytes", "path"}) whose images take, in order, the
`<image>` placeholders of the text (LlamaFactory's form) or the image parts without a source. A
relative path is read from the data file's folder. Such a row is an ImageChat.
"""

from __future__ import annotations

import dataclasses

from mtjax.data import chat
from mtjax.data.readers import BadRow

FORMATS = ("auto", "text", "alpaca", "sharegpt", "messages", "prompt_completion", "preference",
           "chat", "jsonl")

# Each field a format reads, and the column it is read from unless --columns renames it.
FIELDS = {"text": "text", "instruction": "instruction", "input": "input", "output": "output",
          "system": "system", "history": "history", "conversations": "conversations",
          "messages": "messages", "role": None, "content": None, "prompt": "prompt",
          "completion": "completion", "chosen": "chosen", "rejected": "rejected",
          "images": "images"}

PLACEHOLDER = "<image>"  # where an image of the images column goes in a text (LlamaFactory's)

# ShareGPT's roles (LlamaFactory's tags too) as the chat templates name them.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool",
                  "function_call": "assistant"}


@dataclasses.dataclass(frozen=True)
class Pair:
  """A preference example: the prompt conversation and two answers to it."""
  prompt: list  # messages before the answer
  chosen: str
  rejected: str


@dataclasses.dataclass(frozen=True)
class ImageChat:
  """A conversation with images: every message's content a list of parts, {"type": "text",
  "text"} or {"type": "image"} (as a processor's chat template takes them), and the images of the
  image parts in order."""
  messages: list
  images: tuple  # each a path, bytes or a datasets Image value {"bytes", "path"}
  base: str | None = None  # the folder relative paths are read from (the data file's)


@dataclasses.dataclass(frozen=True)
class Mapping:
  """How rows are read: `--columns` (field -> column) and `--roles` (role in the data -> role)."""
  columns: dict = dataclasses.field(default_factory=dict)
  roles: dict = dataclasses.field(default_factory=dict)

  def column(self, field: str) -> str:
    return self.columns.get(field, FIELDS[field])


def parse_pairs(text: str | None, option: str, keys: tuple | None = None) -> dict:
  """`a=b,c=d` as {a: b, c: d}; raises ValueError naming `option` on a malformed or unknown key."""
  out = {}
  for item in (text or "").split(","):
    if not item.strip():
      continue
    key, eq, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not eq or not key or not value:
      raise ValueError(f"{option}: {item!r} is not NAME=VALUE")
    if keys is not None and key not in keys:
      raise ValueError(f"{option}: unknown field {key!r} (fields: {', '.join(keys)})")
    out[key] = value
  return out


def detect(row: dict, mapping: Mapping) -> str:
  """The format of a row from its columns (auto); raises ValueError naming the columns."""
  has = lambda field: mapping.column(field) in row
  if has("chosen") and has("rejected"):
    return "preference"
  for field in ("conversations", "messages"):
    msgs = row.get(mapping.column(field))
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
      return "sharegpt" if "from" in msgs[0] or mapping.columns.get("role") else "messages"
  if has("instruction") and has("output"):
    return "alpaca"
  if has("prompt") and (has("completion") or "completion" not in mapping.columns
                        and "response" in row):
    return "prompt_completion"
  if has("text"):
    return "text"
  raise ValueError(f"--format auto: cannot tell the format of a row with columns "
                   f"{', '.join(map(str, row)) or '(none)'}; pass --format (and --columns)")


def _get(row: dict, mapping: Mapping, field: str, where: str, kinds=(str,), required=True):
  col = mapping.column(field)
  if col not in row or row[col] is None:
    if not required:
      return None
    raise BadRow("missing column", f"{where}: no column {col!r} (the {field} field; rename it "
                 f"with --columns {field}=COLUMN); the row has columns "
                 f"{', '.join(map(str, row)) or '(none)'}")
  value = row[col]
  if not isinstance(value, kinds):
    raise BadRow("wrong type", f"{where}: column {col!r} holds a {type(value).__name__}, not "
                 f"{' or '.join(k.__name__ for k in kinds)}")
  return value


def _system(row: dict, mapping: Mapping, where: str) -> list:
  system = _get(row, mapping, "system", where, required=False)
  return [{"role": "system", "content": system}] if system and system.strip() else []


def _messages(items: list, mapping: Mapping, where: str, roles: dict, role_key: str,
              content_key: str) -> list:
  """Conversation items as {"role", "content"} messages with the roles mapped."""
  roles = {**roles, **mapping.roles}
  out = []
  for k, m in enumerate(items):
    if not isinstance(m, dict) or role_key not in m:
      raise BadRow("bad message", f"{where}: message {k} is not an object with {role_key!r}")
    role = roles.get(m[role_key], m[role_key])
    content = m.get(content_key)
    if content is None:
      content = ""
    if isinstance(content, list):
      content = [_part(x, f"{where}: message {k}") for x in content]
    elif not isinstance(content, str):
      raise BadRow("bad message", f"{where}: message {k}'s {content_key!r} is a "
                   f"{type(content).__name__}, not a string")
    # columnar sources give every message every key of the column's struct: absent ones as None
    rest = {key: v for key, v in m.items() if key not in (role_key, content_key) and v is not None}
    out.append({**rest, "role": role, "content": content})
  return out


_IMAGE_KEYS = ("image", "path", "url", "image_url")  # where an image part names its image


def _part(x, where: str) -> dict:
  """A content part as {"type": "text", "text"} or {"type": "image"} with its source under
  "source" (None: the next image of the images column)."""
  if isinstance(x, str):
    return {"type": "text", "text": x}
  if not isinstance(x, dict):
    raise BadRow("bad message", f"{where}: a content part is a {type(x).__name__}, not an object")
  x = {key: v for key, v in x.items() if v is not None}  # a columnar struct's absent keys
  kind = x.get("type")
  if kind == "text":
    if not isinstance(x.get("text"), str):
      raise BadRow("bad message", f"{where}: a text part without a string 'text'")
    return {"type": "text", "text": x["text"]}
  if kind in ("image", "image_url"):
    source = next((x[key] for key in _IMAGE_KEYS if key in x), None)
    if isinstance(source, dict) and "url" in source and "bytes" not in source:
      source = source["url"]  # OpenAI's {"type": "image_url", "image_url": {"url"}}
    if isinstance(source, str):
      if source.startswith(("http://", "https://")):
        raise BadRow("remote image", f"{where}: image {source}: only local files are read")
      source = source.removeprefix("file://")
    return {"type": "image", "source": source}
  raise BadRow("bad message", f"{where}: a content part of type {kind!r} (text or image)")


def _with_images(msgs: list, row: dict, mapping: Mapping, where: str):
  """The messages, or an ImageChat where they hold images (their parts, or the images column's,
  which fill the `<image>` placeholders of the text and the image parts without a source)."""
  column = row.get(mapping.column("images"))
  if column is None:
    column = []
  elif not isinstance(column, list):
    column = [column]
  has_parts = any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                  for m in msgs)
  if not column and not has_parts:
    # text parts alone read as one string, which text-only templates take too
    return [m if isinstance(m["content"], str) else
            {**m, "content": "".join(p["text"] for p in m["content"])} for m in msgs]
  queue, images, out = list(column), [], []
  for m in msgs:
    parts = m["content"]
    if isinstance(parts, str):
      pieces = parts.split(PLACEHOLDER) if column else [parts]
      parts = [{"type": "text", "text": pieces[0]}]
      for piece in pieces[1:]:
        parts += [{"type": "image", "source": None}, {"type": "text", "text": piece}]
      parts = [p for p in parts if p["type"] == "image" or p["text"]]
    content = []
    for p in parts:
      if p["type"] == "image":
        source = p["source"]
        if source is None:
          if not queue:
            raise BadRow("image count", f"{where}: more {PLACEHOLDER} placeholders and image parts "
                         f"than the {len(column)} images of column {mapping.column('images')!r}")
          source = queue.pop(0)
        images.append(source)
        content.append({"type": "image"})
      else:
        content.append(p)
    out.append({**m, "content": content})
  if queue:
    raise BadRow("image count", f"{where}: {len(column)} images in column "
                 f"{mapping.column('images')!r} for {len(column) - len(queue)} {PLACEHOLDER} "
                 "placeholders and image parts")
  return ImageChat(out, tuple(images))


def check_conversation(msgs: list, where: str) -> list:
  """The conversation if it is one to train on, else a BadRow naming the first problem."""
  found = chat.problem(msgs)
  if found:
    reason, k, message = found
    if reason == "unknown role":
      message += f"; map it with --roles {msgs[k]['role']}=ROLE"
    raise BadRow(reason, f"{where}: {message}")
  return msgs


def _answer(value, field: str, mapping: Mapping, where: str) -> str:
  """A preference answer: a string, or a conversation whose last message is the answer."""
  if isinstance(value, list):
    if not value:
      raise BadRow(f"empty {field} answer", f"{where}: {field} is an empty conversation")
    value = _messages(value[-1:], mapping, where, SHAREGPT_ROLES, "role", "content")[0]["content"]
  if not value.strip():
    raise BadRow(f"empty {field} answer", f"{where}: the {field} answer is empty")
  return value


def document(row: dict, fmt: str, mapping: Mapping, where: str):
  """The document a row holds in format `fmt` (not auto): text, messages or a Pair.

  Raises:
    BadRow: a missing column, an unknown role, an empty assistant turn, ... (its reason groups it);
      a missing column's message names the --format the row looks like, when detect can tell.
  """
  try:
    return _document(row, fmt, mapping, where)
  except BadRow as e:
    if e.reason != "missing column":
      raise
    raise BadRow(e.reason, f"{e}{format_hint(row, fmt, mapping)}") from None


# The formats that read a row the same way (the older names), which a hint need not suggest.
_SAME = {"jsonl": ("text",), "chat": ("messages", "prompt_completion")}


def format_hint(row: dict, fmt: str, mapping: Mapping) -> str:
  """"; it looks like --format X" for a row that `fmt` cannot read, naming the format detect
  picks for it; a plain pointer to --format when detect cannot tell."""
  try:
    guess = detect(row, mapping)
  except ValueError:
    return "; or pass the --format the rows are in (docs/data.md lists them)"
  if guess == fmt or guess in _SAME.get(fmt, ()):
    return ""
  return f"; it looks like --format {guess} (or --format auto, which tells each source's)"


def _document(row: dict, fmt: str, mapping: Mapping, where: str):
  if fmt in ("text", "jsonl"):
    return _get(row, mapping, "text", where)
  if fmt == "chat":
    fmt = "messages" if mapping.column("messages") in row else "prompt_completion"
  if fmt == "alpaca":
    instruction = _get(row, mapping, "instruction", where)
    extra = _get(row, mapping, "input", where, required=False)
    output = _get(row, mapping, "output", where)
    history = _get(row, mapping, "history", where, kinds=(list,), required=False) or []
    msgs = _system(row, mapping, where)
    for k, turn in enumerate(history):
      if not (isinstance(turn, (list, tuple)) and len(turn) == 2
              and all(isinstance(x, str) for x in turn)):
        raise BadRow("bad history", f"{where}: history[{k}] is not a [query, answer] pair")
      msgs += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    query = instruction + ("\n" + extra if extra and extra.strip() else "")
    msgs += [{"role": "user", "content": query}, {"role": "assistant", "content": output}]
    return check_conversation(msgs, where)
  if fmt in ("sharegpt", "messages"):
    field = "conversations" if fmt == "sharegpt" else "messages"
    if fmt == "sharegpt" and mapping.column("conversations") not in row \
        and mapping.column("messages") in row:
      field = "messages"  # ShareGPT-style items under a "messages" column
    items = _get(row, mapping, field, where, kinds=(list,))
    if not items:
      raise BadRow("empty conversation", f"{where}: {mapping.column(field)!r} is empty")
    sharegpt = fmt == "sharegpt"
    role_key = mapping.columns.get("role", "from" if sharegpt else "role")
    content_key = mapping.columns.get("content", "value" if sharegpt else "content")
    msgs = _messages(items, mapping, where, SHAREGPT_ROLES if sharegpt else {}, role_key,
                     content_key)
    if not any(m["role"] == "system" for m in msgs):
      msgs = _system(row, mapping, where) + msgs
    doc = _with_images(msgs, row, mapping, where)
    check_conversation(doc.messages if isinstance(doc, ImageChat) else doc, where)
    return doc
  if fmt == "prompt_completion":
    prompt = _get(row, mapping, "prompt", where)
    if "completion" not in mapping.columns and mapping.column("completion") not in row \
        and "response" in row:
      answer = _get(row, Mapping({**mapping.columns, "completion": "response"}), "completion",
                    where)
    else:
      answer = _get(row, mapping, "completion", where)
    msgs = _system(row, mapping, where) + [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": answer}]
    return check_conversation(msgs, where)
  if fmt == "preference":
    field = "prompt" if mapping.column("prompt") in row or mapping.column("messages") not in row \
        else "messages"
    prompt = _get(row, mapping, field, where, kinds=(str, list))
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    else:
      prompt = _messages(prompt, mapping, where, SHAREGPT_ROLES, "role", "content")
    if any(isinstance(m["content"], list) for m in prompt) or row.get(mapping.column("images")):
      raise BadRow("images in a pair", f"{where}: preference rows with images or content parts "
                   "are not supported")
    if not any(m["role"] == "system" for m in prompt):
      prompt = _system(row, mapping, where) + prompt
    chosen = _answer(_get(row, mapping, "chosen", where, kinds=(str, list)), "chosen", mapping,
                     where)
    rejected = _get(row, mapping, "rejected", where, kinds=(str, list), required=False)
    if rejected is None:
      raise BadRow("no rejected answer", f"{where}: no rejected answer (column "
                   f"{mapping.column('rejected')!r}); the row has columns "
                   f"{', '.join(map(str, row))}")
    rejected = _answer(rejected, "rejected", mapping, where)
    for k, m in enumerate(prompt):
      if m["role"] not in chat.ROLES:
        raise BadRow("unknown role", f"{where}: prompt[{k}] has unknown role {m['role']!r} (not "
                     f"one of {', '.join(chat.ROLES)}; map it with --roles {m['role']}=ROLE)")
    return Pair(prompt, chosen, rejected)
  raise ValueError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
