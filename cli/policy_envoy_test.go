package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/mesh"
)

// TestImportEnvoyDeployExample: deploy/envoy/policies is exactly what
// `policy import-envoy` makes of deploy/envoy/ratelimit (regenerate with
// `limitmesh policy import-envoy --dir deploy/envoy/policies
// deploy/envoy/ratelimit` after removing the old files), and every policy
// there is valid by the node's parser.
func TestImportEnvoyDeployExample(t *testing.T) {
	const src, dst = "../deploy/envoy/ratelimit", "../deploy/envoy/policies"
	out := t.TempDir()
	code, stdout, stderr := run(t, nil, "policy", "import-envoy", src, "--dir", out)
	if code != 0 {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, "note: added rl-foo-bay-unlimited") {
		t.Errorf("stderr lacks the stand-in's note:\n%s", stderr)
	}
	want, _ := filepath.Glob(filepath.Join(dst, "*.json"))
	got, _ := filepath.Glob(filepath.Join(out, "*.json"))
	base := func(ps []string) []string {
		for i, p := range ps {
			ps[i] = filepath.Base(p)
		}
		return ps
	}
	if !slices.Equal(base(slices.Clone(want)), base(slices.Clone(got))) {
		t.Fatalf("files %q, committed %q", base(got), base(want))
	}
	for _, w := range want {
		committed, err := os.ReadFile(w)
		if err != nil {
			t.Fatal(err)
		}
		made, err := os.ReadFile(filepath.Join(out, filepath.Base(w)))
		if err != nil {
			t.Fatal(err)
		}
		if string(committed) != string(made) {
			t.Errorf("%s differs from the import's:\n%s", w, made)
		}
		name := strings.TrimSuffix(filepath.Base(w), ".json")
		if _, err := mesh.ParsePolicy(name, committed); err != nil {
			t.Errorf("%s: %v", w, err)
		}
	}
}

func TestImportEnvoyOutputs(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rl.yaml")
	if err := os.WriteFile(cfg, []byte(`
domain: rl
descriptors:
  - key: X-User-Id
    rate_limit: {unit: minute, requests_per_unit: 3}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	// --json: one line per policy; flags after the file work too.
	code, stdout, stderr := run(t, nil, "policy", "import-envoy", cfg, "--json", "--algorithm", "token_bucket")
	if code != 0 {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
	var line struct {
		Name   string
		Policy struct {
			Match  map[string]string
			Limits []map[string]any
		}
	}
	if err := json.Unmarshal([]byte(stdout), &line); err != nil {
		t.Fatalf("%v: %q", err, stdout)
	}
	// The key's dimension is the bridge's name for it (mesh/envoy).
	if line.Name != "rl-x_user_id" || line.Policy.Match["x_user_id"] != "*" || line.Policy.Limits[0]["rate"] != "3/m" {
		t.Errorf("json line %+v", line)
	}
	code, stdout, _ = run(t, nil, "policy", "import-envoy", cfg)
	if code != 0 || !strings.HasPrefix(stdout, "# rl-x_user_id (limit; ") || !strings.Contains(stdout, "\n  \"match\": {") {
		t.Errorf("exit %d, text output:\n%s", code, stdout)
	}

	// What cannot be mapped is one clear line and exit 1; bad usage is 2.
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("domain: d\ndescriptors:\n  - key: path\n    value: /api*\n    rate_limit: {unit: second, requests_per_unit: 1}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, _, stderr = run(t, nil, "policy", "import-envoy", bad)
	if code != 1 || !strings.Contains(stderr, "bad.yaml:3: d: path=/api*: value \"/api*\" matches by prefix") {
		t.Errorf("exit %d: %s", code, stderr)
	}
	if code, _, _ = run(t, nil, "policy", "import-envoy"); code != 2 {
		t.Errorf("no file: exit %d, want 2", code)
	}
	if code, _, stderr = run(t, nil, "policy", "import-envoy", "--algorithm", "leaky", cfg); code != 1 || !strings.Contains(stderr, `algorithm "leaky"`) {
		t.Errorf("bad algorithm: exit %d %s", code, stderr)
	}
}
