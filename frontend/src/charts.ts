// Every picture on the site is drawn here, with ECharts (tree-shaken to the parts we use).
// A page asks for a chart with <div data-chart="ID"> plus <script type="application/json" id="ID">
// holding the ECharts option, which the server builds; pages that update live call drawChart again.
import { BarChart, GraphChart, HeatmapChart, LineChart, ScatterChart } from "echarts/charts";
import {
  DataZoomComponent,
  GridComponent,
  LegendComponent,
  MarkLineComponent,
  TitleComponent,
  TooltipComponent,
  VisualMapComponent,
} from "echarts/components";
import * as echarts from "echarts/core";
import { SVGRenderer } from "echarts/renderers";

echarts.use([
  BarChart,
  GraphChart,
  HeatmapChart,
  LineChart,
  ScatterChart,
  DataZoomComponent,
  GridComponent,
  LegendComponent,
  MarkLineComponent,
  TitleComponent,
  TooltipComponent,
  VisualMapComponent,
  SVGRenderer,
]);

export type ChartOption = echarts.EChartsCoreOption;

/** Draw (or redraw) one chart into its element; the instance is reused across updates. */
export function drawChart(element: HTMLElement, option: ChartOption): echarts.ECharts {
  const chart = echarts.getInstanceByDom(element) ?? echarts.init(element, undefined, { renderer: "svg" });
  chart.setOption(option, { notMerge: true });
  element.dataset.chartReady = "true";
  return chart;
}

/** Draw every chart the page declares; an option that does not parse leaves a visible note. */
export function drawDeclaredCharts(root: ParentNode = document): void {
  for (const element of root.querySelectorAll<HTMLElement>("[data-chart]")) {
    const source = document.getElementById(element.dataset.chart ?? "");
    if (!source?.textContent) continue;
    try {
      drawChart(element, JSON.parse(source.textContent) as ChartOption);
    } catch (error) {
      element.textContent = `This chart could not be drawn: ${String(error)}`;
    }
  }
}

window.addEventListener("resize", () => {
  for (const element of document.querySelectorAll<HTMLElement>("[data-chart-ready]")) {
    echarts.getInstanceByDom(element)?.resize();
  }
});
