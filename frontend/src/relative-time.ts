// <time datetime="ISO" data-relative> shows "3 min ago" and keeps the absolute time as its tooltip.

const UNITS: Array<[Intl.RelativeTimeFormatUnit, number]> = [
  ["day", 86_400],
  ["hour", 3_600],
  ["minute", 60],
  ["second", 1],
];

export function describeAge(thenMs: number, nowMs: number): string {
  const format = new Intl.RelativeTimeFormat("en", { numeric: "auto" });
  const seconds = Math.round((thenMs - nowMs) / 1000);
  for (const [unit, size] of UNITS) {
    if (Math.abs(seconds) >= size || unit === "second") {
      return format.format(Math.round(seconds / size), unit);
    }
  }
  return "";
}

export function enhanceRelativeTimes(root: ParentNode): void {
  const elements = Array.from(root.querySelectorAll<HTMLTimeElement>("time[data-relative]"));
  const refresh = (): void => {
    const now = Date.now();
    for (const element of elements) {
      const then = Date.parse(element.dateTime);
      if (Number.isNaN(then)) continue;
      element.title = element.title || (element.textContent ?? "");
      element.textContent = describeAge(then, now);
    }
  };
  if (elements.length === 0) return;
  refresh();
  window.setInterval(refresh, 30_000);
}
