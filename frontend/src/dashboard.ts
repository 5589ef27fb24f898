// Monitoring dashboards: <div data-monitoring-api="…" data-monitoring-socket="…" data-monitoring-live="true">
// holds charts declared like every chart (data-chart + JSON option, drawn by charts.ts). While the range ends
// now, the section listens on its workload's WebSocket; a message naming new points makes it fetch the
// (server-downsampled) charts again from the API, at most once per REFRESH_MS. Without a socket it polls.
import "./dashboard.css";
import { drawChart, type ChartOption } from "./charts";

const REFRESH_MS = 3_000;
const POLL_MS = 30_000;

interface Chart {
  metric: string;
  element_id: string;
  option: ChartOption;
}

async function refresh(section: HTMLElement): Promise<void> {
  const url = section.dataset.monitoringApi;
  if (!url) return;
  const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!response.ok) return;
  const body = (await response.json()) as { charts?: Chart[] };
  for (const chart of body.charts ?? []) {
    const element = section.querySelector<HTMLElement>(`[data-chart="${CSS.escape(chart.element_id)}"]`);
    if (element) drawChart(element, chart.option);
  }
  section.dataset.monitoringRefreshed = String(Date.now());
  const note = section.querySelector<HTMLElement>("[data-monitoring-updated]");
  if (note) note.textContent = `Updated at ${new Date().toISOString().slice(11, 19)} UTC with the agents' latest reports.`;
}

function follow(section: HTMLElement): void {
  let pending: number | undefined;
  let last = 0;
  const schedule = (): void => {
    if (pending !== undefined) return;
    const wait = Math.max(0, last + REFRESH_MS - Date.now());
    pending = window.setTimeout(() => {
      pending = undefined;
      last = Date.now();
      refresh(section).catch(() => {
        // Offline or the server restarting: the next message or poll tries again.
      });
    }, wait);
  };
  let open = false;
  const path = section.dataset.monitoringSocket;
  if (path && typeof WebSocket !== "undefined") {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${window.location.host}${path}`);
    socket.addEventListener("open", () => {
      open = true;
      section.dataset.monitoringSocketOpen = "true";
    });
    socket.addEventListener("close", () => {
      open = false;
      delete section.dataset.monitoringSocketOpen;
    });
    socket.addEventListener("message", (event: MessageEvent<string>) => {
      try {
        const message = JSON.parse(event.data) as { type?: string };
        if (message.type === "points") schedule();
      } catch {
        // Not JSON: ignore.
      }
    });
  }
  window.setInterval(() => {
    if (!open && document.visibilityState === "visible") schedule();
  }, POLL_MS);
}

export function enhanceDashboards(root: ParentNode): void {
  for (const section of root.querySelectorAll<HTMLElement>("[data-monitoring-api]")) {
    if (section.dataset.monitoringLive === "true") follow(section);
  }
}
