// A small msgpack decoder: enough for voxgate's binary frames.
//
// Decodes nil, bool, ints (up to 64 bits; beyond 2^53 they lose precision),
// float32/64, str, bin (as Uint8Array views copied out of the frame so they
// are 2-byte aligned for Int16Array), arrays and maps (as plain objects).
// Ext types are skipped over and decode as {ext: type, data: Uint8Array}.
// Encoding is not needed: the page sends JSON text frames.

const utf8 = new TextDecoder("utf-8");

export class MsgpackError extends Error {}

export function decode(input) {
  const bytes = input instanceof Uint8Array ? input : new Uint8Array(input);
  const reader = new Reader(bytes);
  const value = reader.read();
  if (reader.pos !== bytes.length) {
    throw new MsgpackError(
      `expected one msgpack value, got ${bytes.length - reader.pos} trailing bytes`,
    );
  }
  return value;
}

class Reader {
  constructor(bytes) {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.pos = 0;
  }

  need(n) {
    if (this.pos + n > this.bytes.length) {
      throw new MsgpackError(
        `expected ${n} more bytes at offset ${this.pos}, got ${this.bytes.length - this.pos}`,
      );
    }
    const at = this.pos;
    this.pos += n;
    return at;
  }

  u8() { return this.view.getUint8(this.need(1)); }
  u16() { return this.view.getUint16(this.need(2)); }
  u32() { return this.view.getUint32(this.need(4)); }

  u64() {
    const at = this.need(8);
    return this.view.getUint32(at) * 2 ** 32 + this.view.getUint32(at + 4);
  }

  i64() {
    const at = this.need(8);
    return this.view.getInt32(at) * 2 ** 32 + this.view.getUint32(at + 4);
  }

  str(n) {
    const at = this.need(n);
    return utf8.decode(this.bytes.subarray(at, at + n));
  }

  bin(n) {
    const at = this.need(n);
    return this.bytes.slice(at, at + n); // a copy: aligned, and owns its buffer
  }

  array(n) {
    const out = new Array(n);
    for (let i = 0; i < n; i++) out[i] = this.read();
    return out;
  }

  map(n) {
    const out = {};
    for (let i = 0; i < n; i++) {
      const key = this.read();
      out[String(key)] = this.read();
    }
    return out;
  }

  ext(n) {
    const type = this.view.getInt8(this.need(1));
    return { ext: type, data: this.bin(n) };
  }

  read() {
    const b = this.u8();
    if (b <= 0x7f) return b;
    if (b >= 0xe0) return b - 0x100;
    if ((b & 0xf0) === 0x80) return this.map(b & 0x0f);
    if ((b & 0xf0) === 0x90) return this.array(b & 0x0f);
    if ((b & 0xe0) === 0xa0) return this.str(b & 0x1f);
    switch (b) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return this.bin(this.u8());
      case 0xc5: return this.bin(this.u16());
      case 0xc6: return this.bin(this.u32());
      case 0xc7: return this.ext(this.u8());
      case 0xc8: return this.ext(this.u16());
      case 0xc9: return this.ext(this.u32());
      case 0xca: return this.view.getFloat32(this.need(4));
      case 0xcb: return this.view.getFloat64(this.need(8));
      case 0xcc: return this.u8();
      case 0xcd: return this.u16();
      case 0xce: return this.u32();
      case 0xcf: return this.u64();
      case 0xd0: return this.view.getInt8(this.need(1));
      case 0xd1: return this.view.getInt16(this.need(2));
      case 0xd2: return this.view.getInt32(this.need(4));
      case 0xd3: return this.i64();
      case 0xd4: return this.ext(1);
      case 0xd5: return this.ext(2);
      case 0xd6: return this.ext(4);
      case 0xd7: return this.ext(8);
      case 0xd8: return this.ext(16);
      case 0xd9: return this.str(this.u8());
      case 0xda: return this.str(this.u16());
      case 0xdb: return this.str(this.u32());
      case 0xdc: return this.array(this.u16());
      case 0xdd: return this.array(this.u32());
      case 0xde: return this.map(this.u16());
      case 0xdf: return this.map(this.u32());
      default:
        throw new MsgpackError(`expected a msgpack type byte, got 0x${b.toString(16)}`);
    }
  }
}
