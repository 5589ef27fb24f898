// <input data-filter-table="ID"> hides the rows of table#ID whose text does not contain the query.

export function rowMatches(text: string, query: string): boolean {
  const words = query.toLowerCase().split(/\s+/).filter(Boolean);
  const haystack = text.toLowerCase();
  return words.every((word) => haystack.includes(word));
}

export function enhanceFilters(root: ParentNode): void {
  root.querySelectorAll<HTMLInputElement>("input[data-filter-table]").forEach((input) => {
    const table = document.getElementById(input.dataset.filterTable ?? "");
    if (!(table instanceof HTMLTableElement)) return;
    const apply = (): void => {
      let shown = 0;
      for (const row of Array.from(table.tBodies[0]?.rows ?? [])) {
        const visible = rowMatches(row.textContent ?? "", input.value);
        row.hidden = !visible;
        if (visible) shown += 1;
      }
      table.dataset.shownRows = String(shown);
    };
    input.addEventListener("input", apply);
    apply();
  });
}
