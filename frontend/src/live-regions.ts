// Parts of a server-rendered page that follow the server live. An element with data-live-region (and an id)
// and data-live-socket="/ws/..." listens on that WebSocket; whenever the server says something changed, the
// page fetches itself again (same URL, same permission checks as any page load) and swaps in the new content
// of every live region. Without a socket (or while it is closed) it re-reads every 15 s while the tab is
// visible. Nothing is built in the browser: the template stays the one source of the markup.

type Enhance = (root: ParentNode) => void;

export function enhanceLiveRegions(doc: Document, enhance: Enhance, intervalMs = 15_000): void {
  const regions = Array.from(doc.querySelectorAll<HTMLElement>("[data-live-region][id]"));
  if (regions.length === 0) return;
  let socketOpen = false;
  let pending: number | undefined;
  let inFlight = false;

  const refresh = async (): Promise<void> => {
    if (inFlight) return;
    inFlight = true;
    try {
      const response = await fetch(window.location.pathname + window.location.search, {
        credentials: "same-origin",
        headers: { Accept: "text/html" },
      });
      if (!response.ok) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
      for (const region of regions) {
        const next = fresh.getElementById(region.id);
        if (next && next.innerHTML !== region.innerHTML) {
          region.innerHTML = next.innerHTML;
          enhance(region);
        }
      }
      document.dispatchEvent(new CustomEvent("comminsight:refreshed"));
    } catch {
      // Offline or the server restarting: keep what is shown and try again next time.
    } finally {
      inFlight = false;
    }
  };
  const soon = (): void => {
    // Bursts of messages (16 ranks' archives) cost one fetch.
    window.clearTimeout(pending);
    pending = window.setTimeout(() => void refresh(), 500);
  };

  const path = regions.map((r) => r.dataset.liveSocket).find(Boolean);
  if (path && typeof WebSocket !== "undefined") {
    const connect = (delayMs: number): void => {
      const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
      const socket = new WebSocket(`${scheme}//${window.location.host}${path}`);
      socket.addEventListener("open", () => {
        socketOpen = true;
        delayMs = 1_000;
      });
      socket.addEventListener("message", soon);
      socket.addEventListener("close", (event: CloseEvent) => {
        socketOpen = false;
        if (event.code !== 4404) window.setTimeout(() => connect(Math.min(delayMs * 2, 30_000)), delayMs);
      });
    };
    connect(1_000);
  }
  window.setInterval(() => {
    if (!socketOpen && document.visibilityState === "visible") void refresh();
  }, intervalMs);
}
