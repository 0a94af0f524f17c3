// Read a NumPy .npy file (format versions 1 to 3) into {dtype, shape, data}, for the "try it"
// panel. Only what a model input can be: little-endian numbers and booleans, C order.

const TYPES = {
  f2: null, // float16: no typed array; refused with a clear message below
  f4: Float32Array,
  f8: Float64Array,
  i1: Int8Array,
  i2: Int16Array,
  i4: Int32Array,
  i8: BigInt64Array,
  u1: Uint8Array,
  u2: Uint16Array,
  u4: Uint32Array,
  u8: BigUint64Array,
  b1: Uint8Array,
};

export function parseNpy(buffer) {
  const bytes = new Uint8Array(buffer);
  const magic = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]; // \x93NUMPY
  if (bytes.length < 10 || !magic.every((b, i) => bytes[i] === b)) {
    throw new Error("not a .npy file (no \\x93NUMPY magic)");
  }
  const major = bytes[6];
  const view = new DataView(buffer);
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder("latin1").decode(bytes.subarray(start, start + headerLength));

  const descr = /'descr':\s*'([^']+)'/.exec(header);
  const order = /'fortran_order':\s*(True|False)/.exec(header);
  const shapeText = /'shape':\s*\(([^)]*)\)/.exec(header);
  if (!descr || !order || !shapeText) throw new Error("unreadable .npy header");
  if (order[1] === "True") throw new Error("Fortran-ordered arrays are not supported");
  const code = descr[1];
  if (code.startsWith(">")) throw new Error(`big-endian data (${code}) is not supported`);
  const kind = code.replace(/^[<|=]/, "");
  const Type = TYPES[kind];
  if (!Type) throw new Error(`unsupported dtype ${code}`);
  const shape = shapeText[1]
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean)
    .map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const offset = start + headerLength;
  // Copy into an aligned buffer: the data offset need not be a multiple of the item size.
  const body = buffer.slice(offset, offset + count * Type.BYTES_PER_ELEMENT);
  const typed = new Type(body);
  if (typed.length !== count) throw new Error(`the file holds fewer than ${count} values`);
  const data = Array.from(typed, (v) => (typeof v === "bigint" ? Number(v) : v));
  return { dtype: kind === "b1" ? "bool" : code, shape, data };
}
