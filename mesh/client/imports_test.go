package client

import (
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestImportsStayLight: the SDK's non-test files import only the standard
// library and nats.go (no other limitmesh package), so gateways embed it
// cheaply.
func TestImportsStayLight(t *testing.T) {
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
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
			first := strings.SplitN(path, "/", 2)[0]
			if strings.Contains(first, ".") && path != "github.com/nats-io/nats.go" {
				t.Errorf("%s imports %s: only the standard library and nats.go are allowed", name, path)
			}
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no source files checked")
	}
}
