package envoy

import (
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestImportsPointDown: the bridge's non-test files import no package of
// the project above it (the node, the command, the integration tests): the
// node hands it what it needs as functions (package comment).
func TestImportsPointDown(t *testing.T) {
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	const mod = "github.com/limitmesh/limitmesh/"
	checked := 0
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			rest, ours := strings.CutPrefix(path, mod)
			if ours && (rest == "mesh" || strings.HasPrefix(rest, "cli") || strings.HasPrefix(rest, "cmd") || strings.HasPrefix(rest, "integration")) {
				t.Errorf("%s imports %s", name, path)
			}
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no source files checked")
	}
}
