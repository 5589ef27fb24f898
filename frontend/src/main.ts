// Progressive enhancement for the site's server-rendered pages: every page works without this file.
import "./styles.css";
import { enhanceFilters } from "./filter";
import { enhanceRelativeTimes } from "./relative-time";
import { enhanceCopyButtons } from "./copy";
import { enhanceLiveStatus } from "./live-status";
import { enhanceAnalysis } from "./analysis";
import { drawDeclaredCharts } from "./charts";
import { enhanceLiveRegions } from "./live-regions";

// What a freshly swapped-in live region needs again (its own sockets and timers are page-wide).
function enhanceRegion(root: ParentNode): void {
  enhanceRelativeTimes(root);
  enhanceCopyButtons(root);
  drawDeclaredCharts(root);
}
import { enhanceDashboards } from "./dashboard";

function start(): void {
  enhanceFilters(document);
  enhanceRelativeTimes(document);
  enhanceCopyButtons(document);
  enhanceLiveStatus(document);
  enhanceAnalysis(document);
  drawDeclaredCharts(document);
  enhanceLiveRegions(document, enhanceRegion);
  enhanceDashboards(document);
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", start);
} else {
  start();
}
