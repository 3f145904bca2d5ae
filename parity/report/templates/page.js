window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var broken = images.filter(function (img) { return !(img.complete && img.naturalWidth > 0); });
  document.body.setAttribute("data-images-total", String(images.length));
  document.body.setAttribute("data-images-loaded", String(images.length - broken.length));
  broken.forEach(function (img) { img.classList.add("broken"); });
  if (broken.length) {
    var note = document.getElementById("broken-images");
    note.textContent = broken.length + " image(s) failed to load";
    note.hidden = false;
  }
});
