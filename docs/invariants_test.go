// Package docs holds the project's documents; its test keeps
// docs/protocol.md and the code in step.
package docs_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// An invariant is defined in protocol.md by a table row ("| I1 | ...") or a
// bullet ("- **J3 The mark.**", "- **U1** ...").
var definition = regexp.MustCompile(`(?m)^(?:\| ([A-Z][0-9]{1,2}) \||- \*\*([A-Z][0-9]{1,2})\b)`)

// invariants returns the invariants protocol.md defines, in order.
func invariants(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile("protocol.md")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range definition.FindAllStringSubmatch(string(doc), -1) {
		id := m[1] + m[2]
		if slices.Contains(ids, id) {
			t.Errorf("protocol.md defines %s twice: two invariants share a name", id)
			continue
		}
		ids = append(ids, id)
	}
	return ids
}

// sources returns the text of the module's non-test Go files: the code
// that keeps the invariants (the simulation's checks included).
func sources(t *testing.T) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != ".." && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files[path] = string(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestInvariantsCited checks that every invariant protocol.md defines is
// cited by name in the code that keeps it (or, for the simulation's M
// checks, that checks it), and that the code cites no invariant the
// document does not define.
func TestInvariantsCited(t *testing.T) {
	ids := invariants(t)
	if len(ids) < 40 {
		t.Fatalf("found %d invariants in protocol.md (%v): the definition pattern no longer matches the document", len(ids), ids)
	}
	files := sources(t)
	for _, id := range ids {
		cite := regexp.MustCompile(`\b` + id + `\b`)
		found := false
		for _, text := range files {
			if cite.MatchString(text) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("invariant %s (docs/protocol.md) is cited by no Go file outside the document", id)
		}
	}
	// "invariant X9" in code names an invariant the document defines.
	named := regexp.MustCompile(`\binvariants? ([A-Z][0-9]{1,2})\b`)
	for path, text := range files {
		for _, m := range named.FindAllStringSubmatch(text, -1) {
			if !slices.Contains(ids, m[1]) {
				t.Errorf("%s cites invariant %s, which docs/protocol.md does not define", path, m[1])
			}
		}
	}
}
