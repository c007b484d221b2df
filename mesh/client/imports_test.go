package client

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// module is this repository's module path; mesh/client is two levels
// below its root.
const module = "github.com/limitmesh/limitmesh"

// TestImportsStayLight: the SDK's non-test files import only the standard
// library, nats.go and the module's top-level internal packages that
// themselves import only the standard library (internal/wire), so
// gateways embed it cheaply.
func TestImportsStayLight(t *testing.T) {
	checked := 0
	for _, imp := range imports(t, ".") {
		switch {
		case imp.path == "github.com/nats-io/nats.go" || isStd(imp.path):
		case strings.HasPrefix(imp.path, module+"/internal/"):
			dir := filepath.Join("..", "..", strings.TrimPrefix(imp.path, module+"/"))
			for _, sub := range imports(t, dir) {
				if !isStd(sub.path) {
					t.Errorf("%s imports %s, whose %s imports %s: only the standard library is allowed there", imp.file, imp.path, sub.file, sub.path)
				}
			}
		default:
			t.Errorf("%s imports %s: only the standard library, nats.go and stdlib-only internal packages are allowed", imp.file, imp.path)
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no imports checked")
	}
}

type fileImport struct{ file, path string }

// imports returns the imports of the non-test Go files in dir.
func imports(t *testing.T, dir string) []fileImport {
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []fileImport
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(dir, name), nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			out = append(out, fileImport{filepath.Join(dir, name), path})
		}
	}
	return out
}

// isStd reports whether path is a standard library package (no dot in its
// first element).
func isStd(path string) bool { return !strings.Contains(strings.SplitN(path, "/", 2)[0], ".") }
