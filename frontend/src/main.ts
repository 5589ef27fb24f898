// Progressive enhancement for the site's server-rendered pages: every page works without this file.
import "./styles.css";
import { enhanceFilters } from "./filter";
import { enhanceRelativeTimes } from "./relative-time";
import { enhanceCopyButtons } from "./copy";
import { enhanceLiveStatus } from "./live-status";
import { enhanceAnalysis } from "./analysis";

function start(): void {
  enhanceFilters(document);
  enhanceRelativeTimes(document);
  enhanceCopyButtons(document);
  enhanceLiveStatus(document);
  enhanceAnalysis(document);
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", start);
} else {
  start();
}
