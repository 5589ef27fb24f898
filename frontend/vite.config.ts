// Builds src/main.ts (and the CSS it imports) into dist/comminsight/app.{js,css}.
// Django lists frontend/dist in STATICFILES_DIRS, so templates load {% static 'comminsight/app.js' %};
// names carry no hash because production's ManifestStaticFilesStorage adds one.
import { defineConfig } from "vite";

export default defineConfig({
  publicDir: false,
  build: {
    outDir: "dist/comminsight",
    emptyOutDir: true,
    cssCodeSplit: false,
    sourcemap: true,
    target: "es2022",
    rollupOptions: {
      input: "src/main.ts",
      output: {
        entryFileNames: "app.js",
        assetFileNames: "app[extname]",
      },
    },
  },
});
