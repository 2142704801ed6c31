// Live captions from `segment` events, with the word being spoken
// highlighted. Word timings are relative to their segment's start and the
// segment's `pts_ms` is where its audio starts in the context (docs/protocol.md, "A turn"),
// so a word plays at context time pts_ms + start_ms.
//
// Text the server skipped (`text.skipped`: a language no voice of it speaks)
// is shown in place, marked, and counts as never heard: at a barge-in it is
// with the dropped text. Skipped from inside a segment, it carries the
// segment's id and the offset in its text where it was cut out.

const MAX_TURNS = 30;

export class Captions {
  constructor(root) {
    this.root = root;
    this.turns = new Map(); // ctx -> {el, units: [{el, start, end}]}
    this.current = null; // {ctx, unit index} of the last highlight
  }

  turn(ctx, label) {
    let turn = this.turns.get(ctx);
    if (turn) return turn;
    const el = document.createElement("p");
    el.className = "turn";
    el.dataset.ctx = ctx;
    const tag = document.createElement("span");
    tag.className = "tag";
    tag.textContent = label;
    el.append(tag, " ");
    this.root.append(el);
    turn = { el, units: [], segments: new Map() };
    this.turns.set(ctx, turn);
    while (this.turns.size > MAX_TURNS) {
      const [oldest] = this.turns.keys();
      this.turns.get(oldest).el.remove();
      this.turns.delete(oldest);
    }
    return turn;
  }

  addSegment(ctx, label, segment) {
    const turn = this.turn(ctx, label);
    const seg = document.createElement("span");
    seg.className = "seg";
    const text = String(segment.text ?? "");
    const pts = Number(segment.pts_ms) || 0;
    const words = Array.isArray(segment.words) ? segment.words : [];
    let cursor = 0;
    let placed = 0;
    for (const w of words) {
      const word = String(w.word ?? "");
      if (!word) continue;
      let at = text.indexOf(word, cursor);
      if (at < 0) at = text.toLowerCase().indexOf(word.toLowerCase(), cursor);
      if (at < 0) continue;
      if (at > cursor) seg.append(text.slice(cursor, at));
      const span = document.createElement("span");
      span.className = "w";
      span.textContent = text.slice(at, at + word.length);
      seg.append(span);
      turn.units.push({ el: span, start: pts + Number(w.start_ms), end: pts + Number(w.end_ms) });
      cursor = at + word.length;
      placed += 1;
    }
    seg.append(text.slice(cursor));
    if (placed === 0) {
      // No timings: the segment is the unit.
      const duration = Number(segment.duration_ms) || 0;
      turn.units.push({ el: seg, start: pts, end: pts + duration });
    }
    if (turn.el.childNodes.length > 2) turn.el.append(" ");
    turn.el.append(seg);
    if (Number.isInteger(segment.segment_id)) turn.segments.set(segment.segment_id, seg);
    this.root.scrollTop = this.root.scrollHeight;
  }

  addSkipped(ctx, label, skipped) {
    const turn = this.turn(ctx, label);
    const span = document.createElement("span");
    span.className = "skipped";
    span.textContent = String(skipped.text ?? "");
    span.title = `not spoken: no voice for ${skipped.language ?? "this language"}`;
    span.dataset.language = String(skipped.language ?? "");
    // never heard: a unit that no playback time reaches
    turn.units.push({ el: span, start: Infinity, end: Infinity, isSkipped: true });
    const seg = turn.segments.get(skipped.segment_id);
    if (seg && Number.isInteger(skipped.offset)) {
      insertAt(seg, skipped.offset, [document.createTextNode(" "), span]);
    } else {
      if (turn.el.childNodes.length > 2) turn.el.append(" ");
      turn.el.append(span);
    }
    this.root.scrollTop = this.root.scrollHeight;
  }

  // Marks the unit being heard at `playedMs` of ctx, and those already heard.
  highlight(ctx, playedMs) {
    const turn = this.turns.get(ctx);
    if (!turn) return;
    for (const unit of turn.units) {
      const isNow = unit.start <= playedMs && playedMs < unit.end;
      const isSaid = unit.end <= playedMs;
      unit.el.classList.toggle("now", isNow);
      unit.el.classList.toggle("said", isSaid);
    }
  }

  // The whole turn was heard.
  finish(ctx) {
    const turn = this.turns.get(ctx);
    if (!turn) return;
    for (const unit of turn.units) {
      if (unit.isSkipped) continue;
      unit.el.classList.remove("now");
      unit.el.classList.add("said");
    }
  }

  // Barge-in: what was not heard by `playedMs` is struck through.
  cut(ctx, playedMs) {
    const turn = this.turns.get(ctx);
    if (!turn) return;
    turn.el.classList.add("is-cut");
    for (const unit of turn.units) {
      if (unit.isSkipped) continue; // marked as skipped already
      unit.el.classList.remove("now");
      unit.el.classList.toggle("said", unit.end <= playedMs);
      unit.el.classList.toggle("dropped", unit.end > playedMs);
    }
  }

  // Local estimate of what was heard, for when the server cannot say (for
  // a context it has already finished): whole words, or whole segments.
  heardText(ctx, playedMs) {
    const turn = this.turns.get(ctx);
    if (!turn) return { spoken: "", unspoken: "" };
    const spoken = [];
    const unspoken = [];
    for (const unit of turn.units) {
      (unit.end <= playedMs ? spoken : unspoken).push(unit.el.textContent);
    }
    return { spoken: spoken.join(" "), unspoken: unspoken.join(" ") };
  }
}

// Inserts `nodes` into `seg` where `offset` characters of its spoken text
// end (skipped text already placed counts for none).
function insertAt(seg, offset, nodes) {
  let pos = 0;
  for (const child of [...seg.childNodes]) {
    const length = child.classList?.contains("skipped") ? 0 : child.textContent.length;
    if (pos + length > offset) {
      const isInside = child.nodeType === Node.TEXT_NODE && offset > pos;
      const before = isInside ? child.splitText(offset - pos) : child;
      for (const node of nodes) seg.insertBefore(node, before);
      return;
    }
    pos += length;
  }
  seg.append(...nodes);
}
