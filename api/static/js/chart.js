// Line charts on a <canvas>, drawn by hand: the console has no build step and must work
// offline, and a few dozen lines cover what the tuning curves need.

export const COLORS = ["#c2410c", "#2563eb", "#059669", "#7c3aed", "#db2777", "#ca8a04", "#0891b2"];

// series: [{label, color, points: [[x, y], ...]}]; options: {xLabel, yLabel, xZero, yZero}
// (xZero / yZero: the axis starts at 0, so that one point or a flat line reads right).
export function drawChart(
  canvas,
  series,
  { xLabel = "", yLabel = "", xZero = false, yZero = true } = {},
) {
  // Size the backing store to the displayed size times the pixel ratio, so lines stay sharp.
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 480;
  const height = canvas.clientHeight || 220;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);

  const points = series.flatMap((s) => s.points);
  canvas.dataset.points = String(points.length); // lets tests (and curious users) count them
  const pad = { left: 56, right: 12, top: 12, bottom: 36 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  if (!points.length) {
    ctx.fillText("waiting for measurements…", pad.left + 8, pad.top + plotH / 2);
    return;
  }

  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  const [x0, xHi] = spread(xZero ? Math.min(0, ...xs) : Math.min(...xs), Math.max(...xs));
  const x1 = xHi + (xHi - x0) * 0.03; // and a little room on the right, for the last dot
  const [yLo, yHi] = spread(yZero ? Math.min(0, ...ys) : Math.min(...ys), Math.max(...ys));
  // 5% headroom, so the best point is not drawn on the frame.
  const y0 = yLo;
  const y1 = yHi + (yHi - yLo) * 0.05;
  const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * plotW;
  const sy = (y) => pad.top + plotH - ((y - y0) / (y1 - y0)) * plotH;

  // Grid and tick labels.
  ctx.strokeStyle = "#e5e7eb";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const y of ticks(y0, y1, 5)) {
    ctx.beginPath();
    ctx.moveTo(pad.left, sy(y));
    ctx.lineTo(pad.left + plotW, sy(y));
    ctx.stroke();
    ctx.fillText(format(y), pad.left - 6, sy(y));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const x of ticks(x0, x1, 6)) {
    ctx.fillText(format(x), sx(x), pad.top + plotH + 4);
  }
  ctx.fillText(xLabel, pad.left + plotW / 2, height - 14);
  ctx.save();
  ctx.translate(12, pad.top + plotH / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(yLabel, 0, -6);
  ctx.restore();

  // The series: a line, and a dot per point so a single measurement still shows.
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.forEach(([x, y], j) => (j ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
    for (const [x, y] of s.points) {
      ctx.beginPath();
      ctx.arc(sx(x), sy(y), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    }
  });
}

// A range that is never empty, so one point or a flat line still has a scale.
function spread(lo, hi) {
  if (hi > lo) return [lo, hi];
  const d = Math.abs(lo) * 0.1 || 1;
  return [lo - d, hi + d];
}

// "Nice" tick values (1, 2 or 5 times a power of ten) inside [lo, hi].
function ticks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

function format(v) {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1000) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1).replace(/\.0$/, "");
  return Number(v.toPrecision(3)).toString();
}
