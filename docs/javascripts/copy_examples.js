// The copy button of a Python console example copies code that runs when pasted.
//
// The API reference shows docstring examples as doctest sessions, highlighted by Pygments'
// Python console lexer: the prompts ">>> " and "... " are <span class="gp"> and the expected
// output lines <span class="go"> (tracebacks .gt/.gr). Material's copy button copies the text of
// the <code> element as shown, prompts and output included, which is a SyntaxError in a Python
// file or a fresh interpreter. Material reads the copied text from the nearest element with a
// data-copy attribute when there is one (its bundle: `e.closest("[data-copy]")`), so this script
// gives every console block a data-copy holding its code lines only: the lines that start with a
// ">>> " or "... " prompt, without the prompt. Output, tracebacks and blank lines are left out.
// Other code blocks (plain Python, shell, source listings) are not touched.
(function () {
  "use strict";

  const PROMPTS = [">>> ", "... ", ">>>", "..."];

  // The lines of a <code> element as [prompt, text] pairs; prompt is the text of the .gp span
  // that opens the line ("" when the line has none).
  function lines(code) {
    const out = [];
    let prompt = "";
    let text = "";
    let atStart = true;
    const walk = (node) => {
      for (const child of node.childNodes) {
        if (child.nodeType === Node.TEXT_NODE) {
          const parts = child.data.split("\n");
          parts.forEach((part, i) => {
            if (i > 0) {
              out.push([prompt, text]);
              prompt = "";
              text = "";
              atStart = true;
            }
            if (part) {
              text += part;
              atStart = false;
            }
          });
        } else if (child.nodeType === Node.ELEMENT_NODE) {
          if (child.tagName === "A" && !child.textContent) {
            continue; // the line anchors of pymdownx.highlight (anchor_linenums)
          }
          if (atStart && child.classList.contains("gp")) {
            prompt = child.textContent;
            atStart = false;
            continue;
          }
          walk(child);
        }
      }
    };
    walk(code);
    if (prompt || text) {
      out.push([prompt, text]);
    }
    return out;
  }

  // The runnable text of a console block, or null for a block that is not a Python session.
  function runnable(code) {
    const all = lines(code);
    const prompted = all.filter(([prompt]) => PROMPTS.includes(prompt));
    if (!prompted.some(([prompt]) => prompt.startsWith(">>>"))) {
      return null;
    }
    return prompted.map(([, text]) => text).join("\n");
  }

  function mark(root) {
    for (const code of root.querySelectorAll(".highlight pre > code")) {
      if (code.hasAttribute("data-copy") || !code.querySelector(".gp")) {
        continue;
      }
      const text = runnable(code);
      if (text !== null) {
        code.setAttribute("data-copy", text);
      }
    }
  }

  // Material's instant navigation swaps pages without reloading; document$ emits on each page.
  if (typeof document$ !== "undefined") {
    document$.subscribe(() => mark(document));
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", () => mark(document));
  } else {
    mark(document);
  }

  // For tests (Node): the pure functions.
  if (typeof module !== "undefined" && module.exports) {
    module.exports = {lines, runnable, mark};
  }
})();
