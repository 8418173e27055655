// Search result summaries from the page's own text (docs/conf.py adds this file to every page).
//
// Under each result Sphinx's search shows text from the result page's [role="main"] element,
// around the first place it finds a query word (from the top when it finds none, as with
// stemmed words). In this theme that element also holds the article header, whose buttons
// (download, full screen, light/dark, search) and the page's contents list come first, so
// summaries read like "Ctrl+K .md .pdf Contents ...". This takes the text of the article
// (article.bd-article) instead, and Sphinx's own reading where a page has none.
(() => {
  const articleText = (htmlString, anchor) => {
    const page = new DOMParser().parseFromString(htmlString, "text/html");
    const article = page.querySelector("article.bd-article");
    if (!article) return null;
    for (const query of [".headerlink", "script", "style"]) {
      article.querySelectorAll(query).forEach((el) => el.remove());
    }
    let block = null;
    try {
      block = anchor ? article.querySelector(anchor) : null;
    } catch (e) {
      block = null; // an anchor that is no CSS selector: the whole article
    }
    return (block || article).textContent.replace(/\s+/g, " ").trim();
  };
  const patch = () => {
    if (typeof Search === "undefined" || Search.htmlToText.readsArticle) return;
    const sphinxHtmlToText = Search.htmlToText;
    const htmlToText = (htmlString, anchor) =>
      articleText(htmlString, anchor) ?? sphinxHtmlToText(htmlString, anchor);
    htmlToText.readsArticle = true;
    Search.htmlToText = htmlToText;
  };
  patch(); // searchtools.js loaded before this file
  document.addEventListener("DOMContentLoaded", patch); // or after it
})();
