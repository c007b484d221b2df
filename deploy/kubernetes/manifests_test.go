// Package kubernetes_test checks deploy/kubernetes: every manifest decodes
// strictly into the Kubernetes API types (k8s.io/api; an unknown or
// repeated field fails), the secured overlay's patches apply to the base
// (strategic merge, as kustomize applies them), and the manifests agree
// with the binary and with each other: every limitmesh argument and
// LIMITMESH_* variable is a flag `limitmesh serve` accepts (its own flag
// set parses them), container ports match --http and --envoy-listen,
// probes ask the --http port for /readyz and /healthz, the grace period
// covers the preStop pause and --drain-timeout, the NATS configuration
// parses with nats-server's parser and routes to the StatefulSet's pods
// through its headless Service, and the Envoy gateway runs
// deploy/envoy/envoy.yaml, whose rate limit cluster is the limitmesh
// Service's envoy port.
package kubernetes_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/limitmesh/limitmesh/cli"
)

const namespace = "limitmesh"

// object is one decoded manifest document.
type object struct {
	file string
	kind string
	name string
	raw  []byte // the document as JSON
	obj  any    // *corev1.ConfigMap, *appsv1.Deployment, ...
}

func (o object) String() string { return o.file + ": " + o.kind + " " + o.name }

// newObject returns an empty object of kind, as the API types know it.
func newObject(apiVersion, kind string) (any, error) {
	switch apiVersion + " " + kind {
	case "v1 Namespace":
		return &corev1.Namespace{}, nil
	case "v1 ConfigMap":
		return &corev1.ConfigMap{}, nil
	case "v1 Secret":
		return &corev1.Secret{}, nil
	case "v1 Service":
		return &corev1.Service{}, nil
	case "apps/v1 Deployment":
		return &appsv1.Deployment{}, nil
	case "apps/v1 StatefulSet":
		return &appsv1.StatefulSet{}, nil
	case "policy/v1 PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}, nil
	}
	return nil, fmt.Errorf("%s %s: not a kind these manifests use", apiVersion, kind)
}

// decodeStrict decodes one YAML document into obj as the API server's
// strict field validation does: field names are case-sensitive, and an
// unknown or repeated field is an error.
func decodeStrict(doc []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strict, err := sigsjson.UnmarshalStrict(j, obj, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

// readManifests splits file into its YAML documents (as kubectl does) and
// decodes each strictly into its API type.
func readManifests(t *testing.T, file string) []object {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []object
	r := k8syaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if string(j) == "null" {
			continue // only comments
		}
		var tm metav1.TypeMeta
		var meta struct {
			Metadata metav1.ObjectMeta `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		obj, err := newObject(tm.APIVersion, tm.Kind)
		if err != nil {
			t.Fatalf("%s: %s: %v", file, meta.Metadata.Name, err)
		}
		if err := decodeStrict(doc, obj); err != nil {
			t.Fatalf("%s: %s %s: %v", file, tm.Kind, meta.Metadata.Name, err)
		}
		if tm.Kind != "Namespace" && meta.Metadata.Namespace != namespace {
			t.Errorf("%s: %s %s: namespace %q, want %q", file, tm.Kind, meta.Metadata.Name, meta.Metadata.Namespace, namespace)
		}
		out = append(out, object{file: file, kind: tm.Kind, name: meta.Metadata.Name, raw: j, obj: obj})
	}
	return out
}

// kustomization is the part of kustomize's Kustomization these files use,
// decoded strictly.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Patches    []struct {
		Path string `json:"path"`
	} `json:"patches"`
}

func readKustomization(t *testing.T, dir string) kustomization {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := decodeStrict(data, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", dir, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("%s/kustomization.yaml: %s %s", dir, k.APIVersion, k.Kind)
	}
	return k
}

// manifests is a set of objects by kind and name.
type manifests map[string]object

func (m manifests) get(t *testing.T, kind, name string) any {
	t.Helper()
	o, ok := m[kind+"/"+name]
	if !ok {
		t.Fatalf("no %s %s", kind, name)
	}
	return o.obj
}

func (m manifests) add(t *testing.T, objs []object) {
	for _, o := range objs {
		if _, dup := m[o.kind+"/"+o.name]; dup {
			t.Errorf("%s defined twice", o)
		}
		m[o.kind+"/"+o.name] = o
	}
}

// base reads the base kustomization's resources; every manifest file of
// the directory must be one of them.
func base(t *testing.T) manifests {
	t.Helper()
	k := readKustomization(t, ".")
	files, _ := filepath.Glob("*.yaml")
	for _, f := range files {
		if f != "kustomization.yaml" && !slices.Contains(k.Resources, f) {
			t.Errorf("%s is not in kustomization.yaml's resources", f)
		}
	}
	m := manifests{}
	for _, r := range k.Resources {
		m.add(t, readManifests(t, r))
	}
	return m
}

// secured applies the secured overlay's patches to the base, as kustomize
// does (strategic merge, by kind and name).
func secured(t *testing.T) manifests {
	t.Helper()
	k := readKustomization(t, "secured")
	if !slices.Equal(k.Resources, []string{"../"}) {
		t.Errorf("secured resources %v, want the base", k.Resources)
	}
	m := base(t)
	files, _ := filepath.Glob("secured/*.yaml")
	for _, f := range files {
		if f != filepath.Join("secured", "kustomization.yaml") && !slices.ContainsFunc(k.Patches, func(p struct {
			Path string `json:"path"`
		}) bool {
			return filepath.Join("secured", p.Path) == f
		}) {
			t.Errorf("%s is not in the overlay's patches", f)
		}
	}
	for _, p := range k.Patches {
		for _, patch := range readManifests(t, filepath.Join("secured", p.Path)) {
			orig, ok := m[patch.kind+"/"+patch.name]
			if !ok {
				t.Fatalf("%s patches nothing of the base", patch)
			}
			merged, err := strategicpatch.StrategicMergePatch(orig.raw, patch.raw, orig.obj)
			if err != nil {
				t.Fatalf("%s: %v", patch, err)
			}
			obj, _ := newObject(apiVersionOf(orig.obj), orig.kind)
			if err := decodeStrict(merged, obj); err != nil {
				t.Fatalf("%s patched: %v", patch, err)
			}
			m[patch.kind+"/"+patch.name] = object{file: patch.file, kind: orig.kind, name: orig.name, raw: merged, obj: obj}
		}
	}
	return m
}

func apiVersionOf(obj any) string {
	switch obj.(type) {
	case *appsv1.Deployment, *appsv1.StatefulSet:
		return "apps/v1"
	case *policyv1.PodDisruptionBudget:
		return "policy/v1"
	}
	return "v1"
}

func TestBase(t *testing.T) {
	m := base(t)
	checkNATS(t, m, "")
	checkLimitmesh(t, m, false)
	checkEnvoy(t, m)
	checkSelectors(t, m)
}

func TestSecured(t *testing.T) {
	m := secured(t)
	// auth.conf as the operator makes it: a deployment and its nats-config.
	dir := filepath.Join(t.TempDir(), "secure")
	var out, errs bytes.Buffer
	if code := cli.Main(t.Context(), []string{"auth", "init", dir, "--tenants", "acme"}, nil, nil, &out, &errs); code != 0 {
		t.Fatalf("auth init: %s", errs.String())
	}
	out.Reset()
	if code := cli.Main(t.Context(), []string{"auth", "nats-config", dir}, nil, nil, &out, &errs); code != 0 {
		t.Fatalf("auth nats-config: %s", errs.String())
	}
	checkNATS(t, m, out.String())
	checkLimitmesh(t, m, true)
	checkEnvoy(t, m)
	checkSelectors(t, m)

	// The NATS pods' config volume holds nats.conf and auth.conf.
	sts := m.get(t, "StatefulSet", "nats").(*appsv1.StatefulSet)
	var sources []string
	for _, v := range sts.Spec.Template.Spec.Volumes {
		if v.Name != "config" {
			continue
		}
		if v.ConfigMap != nil || v.Projected == nil {
			t.Fatalf("config volume %+v: want only the projected one", v)
		}
		for _, s := range v.Projected.Sources {
			sources = append(sources, s.ConfigMap.Name)
		}
	}
	if !slices.Equal(sources, []string{"nats-config", "nats-auth"}) {
		t.Errorf("config volume sources %v", sources)
	}
}

// container returns the pod template's container named name.
func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

// portOf resolves a probe's or Service's port (a number or a container
// port's name) to a number.
func portOf(t *testing.T, c corev1.Container, p intstr.IntOrString) int32 {
	t.Helper()
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	t.Fatalf("container %s has no port named %q", c.Name, p.StrVal)
	return 0
}

func namedPort(t *testing.T, c corev1.Container, name string) int32 {
	t.Helper()
	return portOf(t, c, intstr.FromString(name))
}

// expand replaces $(VAR) in s as the kubelet does, with sample values for
// the container's fieldRef variables.
func expand(s string, c corev1.Container) string {
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			v = map[string]string{"metadata.name": "limitmesh-5d8f7c9b4-x2x7q", "metadata.namespace": namespace}[e.ValueFrom.FieldRef.FieldPath]
		}
		s = strings.ReplaceAll(s, "$("+e.Name+")", v)
	}
	return s
}

func hostPort(t *testing.T, hp string) (string, int32) {
	t.Helper()
	h, p, err := net.SplitHostPort(hp)
	if err != nil {
		t.Fatalf("%q: %v", hp, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("%q: %v", hp, err)
	}
	return h, int32(n)
}

func checkLimitmesh(t *testing.T, m manifests, secure bool) {
	d := m.get(t, "Deployment", "limitmesh").(*appsv1.Deployment)
	spec := d.Spec.Template.Spec
	c := container(t, spec, "limitmesh")
	if len(c.Command) > 0 || len(c.Args) == 0 || c.Args[0] != "serve" {
		t.Fatalf("limitmesh container: command %q args %q: want the image's entrypoint with serve ...", c.Command, c.Args)
	}
	var args, environ []string
	for _, a := range c.Args[1:] {
		args = append(args, expand(a, c))
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			environ = append(environ, e.Name+"="+e.Value)
		} else if strings.HasPrefix(e.Name, "LIMITMESH_") {
			t.Errorf("%s comes from a reference: this test cannot check its value", e.Name)
		}
	}
	st, err := cli.ParseServe(args, environ)
	if err != nil {
		t.Fatalf("the limitmesh arguments: %v", err)
	}

	// Ports: --http and --envoy-listen listen on every interface, on the
	// container ports named http and envoy.
	for flag, pair := range map[string][2]string{"--http": {st.HTTP, "http"}, "--envoy-listen": {st.EnvoyListen, "envoy"}} {
		if pair[0] == "" {
			t.Errorf("%s is not set", flag)
			continue
		}
		h, p := hostPort(t, pair[0])
		if h != "0.0.0.0" && h != "" {
			t.Errorf("%s %s: a pod's server must listen on 0.0.0.0", flag, pair[0])
		}
		if got := namedPort(t, c, pair[1]); got != p {
			t.Errorf("container port %s is %d, %s %d", pair[1], got, flag, p)
		}
	}
	_, httpPort := hostPort(t, st.HTTP)

	// Probes: on the --http port, /readyz for readiness, /healthz else.
	for what, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
		want := "/healthz"
		if what == "readiness" {
			want = "/readyz"
		}
		if pr == nil || pr.HTTPGet == nil {
			t.Errorf("no %s probe over HTTP", what)
			continue
		}
		if pr.HTTPGet.Path != want || portOf(t, c, pr.HTTPGet.Port) != httpPort {
			t.Errorf("%s probe %s on port %v, want %s on %d", what, pr.HTTPGet.Path, pr.HTTPGet.Port.String(), want, httpPort)
		}
	}

	// Graceful drain: the preStop pause, then --drain-timeout, within the
	// grace period with 5s to spare for the process to exit.
	var pause time.Duration
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
		pause = time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	}
	if spec.TerminationGracePeriodSeconds == nil {
		t.Fatal("no terminationGracePeriodSeconds")
	}
	if grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second; pause+st.DrainTimeout+5*time.Second > grace {
		t.Errorf("grace period %v < preStop %v + --drain-timeout %v + 5s", grace, pause, st.DrainTimeout)
	}

	// Prometheus scrapes the --http port.
	ann := d.Spec.Template.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != strconv.Itoa(int(httpPort)) || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("scrape annotations %v, want port %d path /metrics", ann, httpPort)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want cpu and memory requests and a memory limit", c.Resources)
	}
	if pdb := m.get(t, "PodDisruptionBudget", "limitmesh").(*policyv1.PodDisruptionBudget); pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("limitmesh PDB maxUnavailable %v, want 1", pdb.Spec.MaxUnavailable)
	}

	// --nats-url names every NATS server by its headless Service, on the
	// client port; --replicas is the NATS cluster's size.
	sts := m.get(t, "StatefulSet", "nats").(*appsv1.StatefulSet)
	nc := container(t, sts.Spec.Template.Spec, "nats")
	var want []string
	for i := range int(*sts.Spec.Replicas) {
		want = append(want, fmt.Sprintf("%s-%d.%s:%d", sts.Name, i, sts.Spec.ServiceName, namedPort(t, nc, "client")))
	}
	var got []string
	for _, u := range strings.Split(st.NATSURL, ",") {
		pu, err := url.Parse(u)
		if err != nil || pu.Scheme != "nats" {
			t.Fatalf("--nats-url entry %q", u)
		}
		got = append(got, pu.Host)
	}
	if !slices.Equal(got, want) {
		t.Errorf("--nats-url hosts %v, want %v", got, want)
	}
	if st.Replicas != int(*sts.Spec.Replicas) {
		t.Errorf("--replicas %d, NATS servers %d", st.Replicas, *sts.Spec.Replicas)
	}

	// The limitmesh Service: headless (Envoy resolves every node), its
	// ports the container's.
	svc := m.get(t, "Service", "limitmesh").(*corev1.Service)
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("limitmesh Service clusterIP %q, want None", svc.Spec.ClusterIP)
	}
	for _, p := range svc.Spec.Ports {
		if portOf(t, c, p.TargetPort) != p.Port {
			t.Errorf("limitmesh Service port %s: %d -> %s", p.Name, p.Port, p.TargetPort.String())
		}
	}

	// Secured: the creds file is the Secret's node.creds.
	if !secure {
		if st.Creds != "" {
			t.Errorf("base sets --creds %q", st.Creds)
		}
		return
	}
	dir, file := filepath.Split(st.Creds)
	var mounted bool
	for _, vm := range c.VolumeMounts {
		if filepath.Clean(vm.MountPath) != filepath.Clean(dir) {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name == vm.Name && v.Secret != nil && v.Secret.SecretName == "limitmesh-creds" && file == "node.creds" {
				mounted = true
			}
		}
	}
	if !mounted {
		t.Errorf("--creds %q is not node.creds of the Secret limitmesh-creds", st.Creds)
	}
	if spec.SecurityContext == nil || spec.SecurityContext.FSGroup == nil || spec.SecurityContext.RunAsUser == nil || *spec.SecurityContext.FSGroup != *spec.SecurityContext.RunAsUser {
		t.Error("the nonroot user must read the creds: fsGroup = runAsUser")
	}
}

// checkNATS parses the NATS configuration with nats-server's parser (with
// auth.conf beside it when authConf is given) and checks it against the
// StatefulSet and its Services.
func checkNATS(t *testing.T, m manifests, authConf string) {
	sts := m.get(t, "StatefulSet", "nats").(*appsv1.StatefulSet)
	cm := m.get(t, "ConfigMap", "nats-config").(*corev1.ConfigMap)
	svc := m.get(t, "Service", sts.Spec.ServiceName).(*corev1.Service)
	c := container(t, sts.Spec.Template.Spec, "nats")
	if *sts.Spec.Replicas != 3 {
		t.Errorf("NATS replicas %d, want 3", *sts.Spec.Replicas)
	}
	if svc.Spec.ClusterIP != corev1.ClusterIPNone || !svc.Spec.PublishNotReadyAddresses {
		t.Errorf("Service %s: want headless with publishNotReadyAddresses (routes resolve before the pods are ready)", svc.Name)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 1 {
		t.Fatalf("NATS volumeClaimTemplates %d", len(sts.Spec.VolumeClaimTemplates))
	}
	dataMount := ""
	for _, vm := range c.VolumeMounts {
		if vm.Name == sts.Spec.VolumeClaimTemplates[0].Name {
			dataMount = vm.MountPath
		}
	}

	// The configuration file the container reads, as nats-server reads it.
	if !slices.Equal(c.Args[:1], []string{"--config"}) || len(c.Args) != 2 {
		t.Fatalf("nats args %q", c.Args)
	}
	confDir := t.TempDir()
	conf := cm.Data[filepath.Base(c.Args[1])]
	// The store directory is the PVC's mount: moved into the temp dir.
	conf = strings.ReplaceAll(conf, "store_dir: "+dataMount, "store_dir: "+strconv.Quote(filepath.Join(confDir, "data")))
	if !strings.Contains(conf, filepath.Join(confDir, "data")) {
		t.Errorf("nats.conf's store_dir is not the data volume's mount %s", dataMount)
	}
	if err := os.WriteFile(filepath.Join(confDir, "nats.conf"), []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	if authConf != "" {
		if err := os.WriteFile(filepath.Join(confDir, "auth.conf"), []byte(authConf), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("POD_NAME", "nats-1")
	opts, err := server.ProcessConfigFile(filepath.Join(confDir, "nats.conf"))
	if err != nil {
		t.Fatalf("nats-server rejects nats.conf: %v", err)
	}
	if opts.ServerName != "nats-1" || !opts.JetStream {
		t.Errorf("server_name %q (want the pod's name), jetstream %v", opts.ServerName, opts.JetStream)
	}
	if authConf != "" && (len(opts.TrustedOperators) != 1 || opts.SystemAccount == "") {
		t.Errorf("secured nats.conf: trusted operators %d, system account %q", len(opts.TrustedOperators), opts.SystemAccount)
	}
	if authConf == "" && len(opts.TrustedOperators) != 0 {
		t.Error("the base runs NATS in operator mode")
	}
	if int32(opts.Port) != namedPort(t, c, "client") || int32(opts.Cluster.Port) != namedPort(t, c, "cluster") || int32(opts.HTTPPort) != namedPort(t, c, "monitor") {
		t.Errorf("nats.conf ports client %d cluster %d http %d differ from the container's", opts.Port, opts.Cluster.Port, opts.HTTPPort)
	}
	var routes []string
	for _, r := range opts.Routes {
		routes = append(routes, r.Host)
	}
	var want []string
	for i := range int(*sts.Spec.Replicas) {
		want = append(want, fmt.Sprintf("%s-%d.%s:%d", sts.Name, i, svc.Name, namedPort(t, c, "cluster")))
	}
	if !slices.Equal(routes, want) {
		t.Errorf("routes %v, want every pod through the headless Service: %v", routes, want)
	}
	for _, p := range svc.Spec.Ports {
		if portOf(t, c, p.TargetPort) != p.Port {
			t.Errorf("Service %s port %s: %d -> %s", svc.Name, p.Name, p.Port, p.TargetPort.String())
		}
	}
	for what, pr := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
		if pr == nil || pr.HTTPGet == nil || portOf(t, c, pr.HTTPGet.Port) != int32(opts.HTTPPort) || !strings.HasPrefix(pr.HTTPGet.Path, "/healthz") {
			t.Errorf("NATS %s probe: want /healthz on the monitoring port", what)
		}
	}
	if pdb := m.get(t, "PodDisruptionBudget", "nats").(*policyv1.PodDisruptionBudget); pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("NATS PDB maxUnavailable %v, want 1 (quorum: 2 of 3)", pdb.Spec.MaxUnavailable)
	}
}

// checkEnvoy: the gateway runs deploy/envoy/envoy.yaml as it is, and its
// rate limit cluster is the limitmesh Service's envoy port.
func checkEnvoy(t *testing.T, m manifests) {
	cm := m.get(t, "ConfigMap", "envoy-config").(*corev1.ConfigMap)
	file, err := os.ReadFile("../envoy/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data["envoy.yaml"] != string(file) {
		t.Error("ConfigMap envoy-config's envoy.yaml differs from deploy/envoy/envoy.yaml")
	}
	d := m.get(t, "Deployment", "envoy").(*appsv1.Deployment)
	c := container(t, d.Spec.Template.Spec, "envoy")
	i := slices.Index(c.Args, "-c")
	if i < 0 || i+1 >= len(c.Args) {
		t.Fatalf("envoy args %q: no -c", c.Args)
	}
	mounted := false
	for _, vm := range c.VolumeMounts {
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name == vm.Name && v.ConfigMap != nil && v.ConfigMap.Name == cm.Name && filepath.Join(vm.MountPath, "envoy.yaml") == c.Args[i+1] {
				mounted = true
			}
		}
	}
	if !mounted {
		t.Errorf("envoy -c %s is not envoy.yaml of the ConfigMap %s", c.Args[i+1], cm.Name)
	}

	// The limitmesh cluster of envoy.yaml: the limitmesh Service, the
	// port whose target is the container's envoy port.
	var boot struct {
		StaticResources struct {
			Clusters []struct {
				Name           string `json:"name"`
				LoadAssignment struct {
					Endpoints []struct {
						LbEndpoints []struct {
							Endpoint struct {
								Address struct {
									SocketAddress struct {
										Address   string `json:"address"`
										PortValue int32  `json:"port_value"`
									} `json:"socket_address"`
								} `json:"address"`
							} `json:"endpoint"`
						} `json:"lb_endpoints"`
					} `json:"endpoints"`
				} `json:"load_assignment"`
			} `json:"clusters"`
		} `json:"static_resources"`
	}
	if err := yaml.Unmarshal(file, &boot); err != nil {
		t.Fatal(err)
	}
	svc := m.get(t, "Service", "limitmesh").(*corev1.Service)
	lm := container(t, m.get(t, "Deployment", "limitmesh").(*appsv1.Deployment).Spec.Template.Spec, "limitmesh")
	found := false
	for _, cl := range boot.StaticResources.Clusters {
		if cl.Name != "limitmesh" {
			continue
		}
		found = true
		sa := cl.LoadAssignment.Endpoints[0].LbEndpoints[0].Endpoint.Address.SocketAddress
		if sa.Address != svc.Name {
			t.Errorf("envoy.yaml's limitmesh cluster resolves %q, the Service is %q", sa.Address, svc.Name)
		}
		ok := false
		for _, p := range svc.Spec.Ports {
			if p.Port == sa.PortValue && portOf(t, lm, p.TargetPort) == namedPort(t, lm, "envoy") {
				ok = true
			}
		}
		if !ok {
			t.Errorf("envoy.yaml asks port %d: not the limitmesh Service's port of --envoy-listen", sa.PortValue)
		}
	}
	if !found {
		t.Error("envoy.yaml has no limitmesh cluster")
	}
	if pr := c.ReadinessProbe; pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Path != "/ready" {
		t.Error("envoy readiness probe: want the admin's /ready")
	}
}

// checkSelectors: every Service and PodDisruptionBudget selects the pods
// of one workload, and every workload's selector matches its template.
func checkSelectors(t *testing.T, m manifests) {
	pods := map[string]map[string]string{}
	for _, o := range m {
		switch w := o.obj.(type) {
		case *appsv1.Deployment:
			pods[o.name] = w.Spec.Template.Labels
			checkSelector(t, o, w.Spec.Selector.MatchLabels, w.Spec.Template.Labels)
		case *appsv1.StatefulSet:
			pods[o.name] = w.Spec.Template.Labels
			checkSelector(t, o, w.Spec.Selector.MatchLabels, w.Spec.Template.Labels)
		}
	}
	selects := func(sel map[string]string) bool {
		for _, labels := range pods {
			if len(sel) > 0 && selected(sel, labels) {
				return true
			}
		}
		return false
	}
	for _, o := range m {
		switch w := o.obj.(type) {
		case *corev1.Service:
			if !selects(w.Spec.Selector) {
				t.Errorf("%s selects no workload's pods", o)
			}
		case *policyv1.PodDisruptionBudget:
			if !selects(w.Spec.Selector.MatchLabels) {
				t.Errorf("%s selects no workload's pods", o)
			}
		}
	}
}

func checkSelector(t *testing.T, o object, sel, labels map[string]string) {
	if !selected(sel, labels) {
		t.Errorf("%s: selector %v does not match its template's labels %v", o, sel, labels)
	}
}

func selected(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// TestStrictDecoding proves the decoding is strict: an unknown field of a
// container and a repeated key are refused.
func TestStrictDecoding(t *testing.T) {
	for _, doc := range []string{
		"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      containers:\n        - name: c\n          args: [serve]\n          livenessprobe: {}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  clusterIP: None\n  clusterIP: None\n",
	} {
		var tm metav1.TypeMeta
		_ = yaml.Unmarshal([]byte(doc), &tm)
		obj, _ := newObject(tm.APIVersion, tm.Kind)
		if err := decodeStrict([]byte(doc), obj); err == nil {
			t.Errorf("accepted:\n%s", doc)
		}
	}
	// And ParseServe refuses what serve refuses.
	for _, tc := range []struct {
		args, env []string
	}{
		{[]string{"--nats-urls=nats://x:4222"}, nil},
		{[]string{"--replicas=9"}, nil},
		{nil, []string{"LIMITMESH_DRAIN_TIMEOUTS=5s"}},
	} {
		if _, err := cli.ParseServe(tc.args, tc.env); err == nil {
			t.Errorf("ParseServe(%q, %q) accepted", tc.args, tc.env)
		}
	}
}
