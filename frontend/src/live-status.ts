// <span data-live-status="/api/v1/workloads/7/" data-live-socket="/ws/workloads/7/"> keeps a workload's
// status badge current: pushed over the WebSocket when it is open, else by polling the (session-
// authenticated, same-origin) API every 15 s while the tab is visible.

const LABELS: Record<string, string> = {
  unknown: "No live data",
  running: "Running",
  hung: "Hung",
  finished: "Finished",
  lost: "Lost",
};

export function applyStatus(badge: HTMLElement, status: string): void {
  if (!(status in LABELS)) return;
  badge.className = `badge badge-${status}`;
  badge.textContent = LABELS[status];
  badge.dataset.status = status;
}

function subscribe(badge: HTMLElement, open: Set<HTMLElement>): void {
  const path = badge.dataset.liveSocket;
  if (!path || typeof WebSocket === "undefined") return;
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(`${scheme}//${window.location.host}${path}`);
  socket.addEventListener("open", () => open.add(badge));
  socket.addEventListener("close", () => open.delete(badge));
  socket.addEventListener("message", (event: MessageEvent<string>) => {
    try {
      const message: unknown = JSON.parse(event.data);
      if (message && typeof message === "object" && "status" in message && typeof message.status === "string") {
        applyStatus(badge, message.status);
      }
    } catch {
      // Not JSON: ignore.
    }
  });
}

export function enhanceLiveStatus(root: ParentNode, intervalMs = 15_000): void {
  const badges = Array.from(root.querySelectorAll<HTMLElement>("[data-live-status]"));
  if (badges.length === 0) return;
  const pushed = new Set<HTMLElement>();
  badges.forEach((badge) => subscribe(badge, pushed));
  const refresh = async (): Promise<void> => {
    if (document.visibilityState !== "visible") return;
    for (const badge of badges) {
      if (pushed.has(badge)) continue;
      try {
        const response = await fetch(badge.dataset.liveStatus ?? "", {
          credentials: "same-origin",
          headers: { Accept: "application/json" },
        });
        if (!response.ok) continue;
        const body: unknown = await response.json();
        if (body && typeof body === "object" && "status" in body && typeof body.status === "string") {
          applyStatus(badge, body.status);
        }
      } catch {
        // Offline or the server restarting: keep the last known status and try again next time.
      }
    }
  };
  window.setInterval(() => void refresh(), intervalMs);
}
