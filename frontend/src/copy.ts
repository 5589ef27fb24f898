// Adds a "Copy" button to every <pre class="code"> (agent set-up snippets, a new token).

export function enhanceCopyButtons(root: ParentNode): void {
  root.querySelectorAll<HTMLPreElement>("pre.code").forEach((pre) => {
    if (!navigator.clipboard) return;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "small copy";
    button.textContent = "Copy";
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.textContent ?? "");
        button.textContent = "Copied";
      } catch {
        button.textContent = "Select and copy";
      }
    });
    pre.insertAdjacentElement("afterend", button);
  });
}
