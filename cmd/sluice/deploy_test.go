package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The Kubernetes manifests of deploy/ are checked against the flag sets of
// the binaries they run: the kustomization is rendered (resources,
// configMapGenerator, images) without kustomize, every container's
// environment is resolved, and the command's own flag parsing must accept
// it. Adding a flag to `sluice proxy` or `sluice control` without setting it
// in the manifests fails here.

const deployDir = "../../deploy"

type kustomization struct {
	Resources          []string `json:"resources"`
	ConfigMapGenerator []struct {
		Name     string   `json:"name"`
		Literals []string `json:"literals"`
	} `json:"configMapGenerator"`
	Images []image `json:"images"`
}

type image struct {
	Name    string `json:"name"`
	NewName string `json:"newName"`
	NewTag  string `json:"newTag"`
}

type volume struct {
	Name     string          `json:"name"`
	EmptyDir json.RawMessage `json:"emptyDir"`
}

type volumeMount struct {
	Name      string `json:"name"`
	MountPath string `json:"mountPath"`
}

type k8sObject struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Template struct {
			Spec podSpec `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

type podSpec struct {
	SecurityContext struct {
		RunAsNonRoot *bool `json:"runAsNonRoot"`
		RunAsUser    int   `json:"runAsUser"`
	} `json:"securityContext"`
	Containers []container `json:"containers"`
	Volumes    []volume    `json:"volumes"`
}

type container struct {
	Name    string   `json:"name"`
	Image   string   `json:"image"`
	Command []string `json:"command"`
	Args    []string `json:"args"`
	Ports   []struct {
		Name          string `json:"name"`
		ContainerPort int    `json:"containerPort"`
	} `json:"ports"`
	EnvFrom []struct {
		ConfigMapRef *struct {
			Name string `json:"name"`
		} `json:"configMapRef"`
		SecretRef *struct {
			Name string `json:"name"`
		} `json:"secretRef"`
	} `json:"envFrom"`
	Env []struct {
		Name      string  `json:"name"`
		Value     *string `json:"value"`
		ValueFrom *struct {
			FieldRef *struct {
				FieldPath string `json:"fieldPath"`
			} `json:"fieldRef"`
			ConfigMapKeyRef *keyRef `json:"configMapKeyRef"`
			SecretKeyRef    *keyRef `json:"secretKeyRef"`
		} `json:"valueFrom"`
	} `json:"env"`
	ReadinessProbe *probe        `json:"readinessProbe"`
	LivenessProbe  *probe        `json:"livenessProbe"`
	VolumeMounts   []volumeMount `json:"volumeMounts"`
}

type keyRef struct {
	Name     string `json:"name"`
	Key      string `json:"key"`
	Optional bool   `json:"optional"`
}

type probe struct {
	HTTPGet *struct {
		Path string `json:"path"`
		Port string `json:"port"`
	} `json:"httpGet"`
}

// secretNames are the settings that must come from a Secret, never from a
// literal value or a ConfigMap.
var secretNames = []string{"SLUICE_DATABASE_URL", "SLUICE_ADMIN_TOKEN", "SLUICE_KEY_PEPPER", "SLUICE_KEK", "SLUICE_REDIS_URL"}

// envSource says where a container's variable comes from.
type envSource struct {
	value  string // resolved value (a placeholder for secrets and fields)
	secret bool   // from a Secret
	field  string // fieldRef path
}

// renderedContainer is one container of the rendered kustomization.
type renderedContainer struct {
	obj  string // Kind/name
	pod  podSpec
	c    container
	env  map[string]envSource
	args []string
}

func readDeploy(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// renderKustomization loads deploy/kustomization.yaml and every resource it
// lists, and resolves each container's environment against the generated
// ConfigMaps. It fails the test on any dangling reference.
func renderKustomization(t *testing.T) (kustomization, []renderedContainer) {
	t.Helper()
	var k kustomization
	if err := yaml.Unmarshal(readDeploy(t, "kustomization.yaml"), &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	configMaps := map[string]map[string]string{}
	for _, g := range k.ConfigMapGenerator {
		m := map[string]string{}
		for _, l := range g.Literals {
			name, value, ok := strings.Cut(l, "=")
			if !ok {
				t.Fatalf("ConfigMap %s: literal %q is not NAME=VALUE", g.Name, l)
			}
			if _, dup := m[name]; dup {
				t.Errorf("ConfigMap %s sets %s twice", g.Name, name)
			}
			if slices.Contains(secretNames, name) {
				t.Errorf("ConfigMap %s holds the secret %s: it belongs in the sluice-secrets Secret", g.Name, name)
			}
			m[name] = value
		}
		configMaps[g.Name] = m
	}
	var out []renderedContainer
	for _, res := range k.Resources {
		for doc := range strings.SplitSeq(string(readDeploy(t, res)), "\n---") {
			var o k8sObject
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				t.Fatalf("%s: %v", res, err)
			}
			if o.Kind != "Deployment" && o.Kind != "Job" && o.Kind != "StatefulSet" {
				continue
			}
			for _, c := range o.Spec.Template.Spec.Containers {
				rc := renderedContainer{obj: o.Kind + "/" + o.Metadata.Name, pod: o.Spec.Template.Spec, c: c, env: map[string]envSource{}, args: c.Args}
				// envFrom first: explicit env entries override it, as in
				// Kubernetes.
				for _, ef := range c.EnvFrom {
					switch {
					case ef.ConfigMapRef != nil:
						m, ok := configMaps[ef.ConfigMapRef.Name]
						if !ok {
							t.Errorf("%s: envFrom ConfigMap %q is not generated by kustomization.yaml", rc.obj, ef.ConfigMapRef.Name)
						}
						for n, v := range m {
							rc.env[n] = envSource{value: v}
						}
					case ef.SecretRef != nil:
						t.Errorf("%s: envFrom a whole Secret hides which variables it sets; name each key with secretKeyRef", rc.obj)
					}
				}
				for _, e := range c.Env {
					switch {
					case e.Value != nil:
						rc.env[e.Name] = envSource{value: *e.Value}
					case e.ValueFrom == nil:
						t.Errorf("%s: %s has neither value nor valueFrom", rc.obj, e.Name)
					case e.ValueFrom.FieldRef != nil:
						rc.env[e.Name] = envSource{value: "pod-name", field: e.ValueFrom.FieldRef.FieldPath}
					case e.ValueFrom.SecretKeyRef != nil:
						r := e.ValueFrom.SecretKeyRef
						if r.Name != "sluice-secrets" || r.Key != e.Name {
							t.Errorf("%s: %s from Secret %s key %s; deploy/README.md documents sluice-secrets keyed by the variable name", rc.obj, e.Name, r.Name, r.Key)
						}
						rc.env[e.Name] = envSource{value: "from-secret", secret: true}
					case e.ValueFrom.ConfigMapKeyRef != nil:
						r := e.ValueFrom.ConfigMapKeyRef
						v, ok := configMaps[r.Name][r.Key]
						if !ok && !r.Optional {
							t.Errorf("%s: %s from ConfigMap %s key %s, which kustomization.yaml does not generate", rc.obj, e.Name, r.Name, r.Key)
						}
						rc.env[e.Name] = envSource{value: v}
					default:
						t.Errorf("%s: %s: unsupported valueFrom", rc.obj, e.Name)
					}
				}
				out = append(out, rc)
			}
		}
	}
	return k, out
}

// flagInfo is one flag of a command's flag set, from its -h output.
type flagInfo struct {
	name string
	envs []string // variables that set it: named in its help, or SLUICE_<NAME>
}

var envNameRE = regexp.MustCompile(`SLUICE_[A-Z0-9_]+`)

// commandSurface runs `sluice <sub> -h` with a recording getenv and returns
// the command's flags and every variable it reads: the ones read while the
// flag set is built, plus the secrets it reads with secret() (after
// parsing, so found in its source file) and their _FILE forms.
func commandSurface(t *testing.T, sub string) ([]flagInfo, map[string]bool) {
	t.Helper()
	read := map[string]bool{}
	getenv := func(name string) string { read[name] = true; return "" }
	var stderr bytes.Buffer
	if err := run(context.Background(), []string{sub, "-h"}, getenv, io.Discard, &stderr); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("sluice %s -h: %v", sub, err)
	}
	src, err := os.ReadFile(sub + ".go")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`secret\(getenv, "(SLUICE_[A-Z0-9_]+)"\)`).FindAllSubmatch(src, -1) {
		read[string(m[1])] = true
		read[string(m[1])+"_FILE"] = true
	}
	var flags []flagInfo
	for line := range strings.SplitSeq(stderr.String(), "\n") {
		if rest, ok := strings.CutPrefix(line, "  -"); ok {
			name, _, _ := strings.Cut(rest, " ")
			flags = append(flags, flagInfo{name: name, envs: []string{"SLUICE_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))}})
		} else if len(flags) > 0 && strings.HasPrefix(line, "    \t") {
			f := &flags[len(flags)-1]
			for _, n := range envNameRE.FindAllString(line, -1) {
				if !slices.Contains(f.envs, n) {
					f.envs = append(f.envs, n)
				}
			}
		}
	}
	if len(flags) == 0 {
		t.Fatalf("sluice %s -h listed no flags:\n%s", sub, stderr.String())
	}
	return flags, read
}

func argFlag(args []string, name string) (string, bool) {
	for _, a := range args {
		a = strings.TrimLeft(a, "-")
		if n, v, _ := strings.Cut(a, "="); n == name {
			return v, true
		}
	}
	return "", false
}

// sets says whether the container sets flag f, by argument or variable.
func (rc renderedContainer) sets(f flagInfo) bool {
	if _, ok := argFlag(rc.args, f.name); ok {
		return true
	}
	return slices.ContainsFunc(f.envs, func(n string) bool { _, ok := rc.env[n]; return ok })
}

// notSetOnPurpose are flags a manifest leaves unset, with the reason.
var notSetOnPurpose = map[string]map[string]string{
	"control": {"migrate": "the sluice-migrate Job migrates; the control plane refuses an out-of-date schema",
		"pprof-addr": "profiler off in clusters; loopback only, enabled per pod and reached with kubectl port-forward (deploy/README.md)"},
	"proxy": {"redis-cluster": "alternative to --redis-url for Redis Cluster (deploy/README.md)",
		"pprof-addr":   "profiler off in clusters; loopback only, enabled per pod and reached with kubectl port-forward (deploy/README.md)",
		"pprof-labels": "goes with --pprof-addr (off in clusters)"},
	"migrate": {"log-level": "defaults", "log-format": "defaults"},
}

// required are variables a command cannot run without in a cluster, each
// with the alternatives that also satisfy it.
var required = map[string][][]string{
	"control": {{"SLUICE_DATABASE_URL"}, {"SLUICE_NATS_URL"}, {"SLUICE_KEY_PEPPER"}, {"SLUICE_KEK"}, {"SLUICE_ADMIN_ADDR"}, {"SLUICE_INSTANCE_ID"}},
	"proxy": {{"SLUICE_NATS_URL"}, {"SLUICE_REDIS_URL", "SLUICE_REDIS_CLUSTER", "--redis-url", "--redis-cluster"},
		{"SLUICE_KEY_PEPPER"}, {"SLUICE_KEK"}, {"SLUICE_PROXY_ADDR"}, {"SLUICE_INSTANCE_ID"}, {"SLUICE_USAGE_SPOOL_DIR"}},
	"migrate": {{"SLUICE_DATABASE_URL"}},
}

func TestDeployManifestsMatchBinaries(t *testing.T) {
	k, containers := renderKustomization(t)
	seen := map[string]bool{}
	for _, rc := range containers {
		t.Run(rc.obj, func(t *testing.T) {
			c := rc.c
			if len(c.Command) != 2 || c.Command[0] != "/sluice" {
				t.Fatalf("command %q: want [/sluice <command>] (the image's binary, deploy/Dockerfile)", c.Command)
			}
			sub := c.Command[1]
			seen[sub] = true
			if !slices.ContainsFunc(k.Images, func(i image) bool { return i.Name == c.Image && i.NewName != "" }) {
				t.Errorf("image %q is not set by kustomization.yaml's images", c.Image)
			}
			if sc := rc.pod.SecurityContext; sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser != 65532 {
				t.Errorf("pod must run as non-root user 65532 (the image's user)")
			}
			flags, read := commandSurface(t, sub)

			// Every variable set is one the command reads.
			for name, src := range rc.env {
				if !read[name] {
					t.Errorf("%s is set but `sluice %s` never reads it", name, sub)
				}
				if slices.Contains(secretNames, name) && !src.secret {
					t.Errorf("%s must come from the sluice-secrets Secret (secretKeyRef), not a value or ConfigMap", name)
				}
			}
			// Every flag is set (or left unset on purpose), and every
			// argument is a flag of the command.
			for _, f := range flags {
				if !rc.sets(f) && notSetOnPurpose[sub][f.name] == "" {
					t.Errorf("flag --%s (%s) of `sluice %s` is not set: add it to args or env, or to notSetOnPurpose with the reason", f.name, strings.Join(f.envs, ", "), sub)
				}
			}
			for _, a := range rc.args {
				name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
				if !slices.ContainsFunc(flags, func(f flagInfo) bool { return f.name == name }) {
					t.Errorf("argument %q is not a flag of `sluice %s`", a, sub)
				}
			}
			for _, alts := range required[sub] {
				if !slices.ContainsFunc(alts, func(n string) bool {
					if f, ok := strings.CutPrefix(n, "--"); ok {
						_, set := argFlag(rc.args, f)
						return set
					}
					_, set := rc.env[n]
					return set
				}) {
					t.Errorf("`sluice %s` needs %s", sub, strings.Join(alts, " or "))
				}
			}
			if src, ok := rc.env["SLUICE_INSTANCE_ID"]; ok && src.field != "metadata.name" {
				t.Errorf("SLUICE_INSTANCE_ID must be the pod name (fieldRef metadata.name), got %+v", src)
			}

			// The command accepts the rendered environment and arguments:
			// its own parsing (durations, integers, flag values) runs up to
			// -h, which stops it before it connects anywhere.
			getenv := func(name string) string { return rc.env[name].value }
			var stderr bytes.Buffer
			if err := run(context.Background(), append(append([]string{sub}, rc.args...), "-h"), getenv, io.Discard, &stderr); !errors.Is(err, flag.ErrHelp) {
				t.Errorf("`sluice %s` refuses the manifest's settings: %v", sub, err)
			}
			if _, err := newLogger(io.Discard, envOr(getenv, "SLUICE_LOG_LEVEL", "info"), envOr(getenv, "SLUICE_LOG_FORMAT", "json")); err != nil {
				t.Error(err)
			}

			// Servers listen on all interfaces, on their container port,
			// and are probed on /readyz and /healthz there.
			addrVar := map[string]string{"control": "SLUICE_ADMIN_ADDR", "proxy": "SLUICE_PROXY_ADDR"}[sub]
			if addrVar == "" {
				if c.ReadinessProbe != nil || c.LivenessProbe != nil {
					t.Errorf("`sluice %s` serves no probes", sub)
				}
				return
			}
			host, port, err := net.SplitHostPort(rc.env[addrVar].value)
			if err != nil || (host != "" && host != "0.0.0.0" && host != "::") {
				t.Errorf("%s=%q: want :PORT (the default listens on loopback only)", addrVar, rc.env[addrVar].value)
			}
			if len(c.Ports) != 1 || c.Ports[0].Name != "http" || c.Ports[0].ContainerPort == 0 || port != strconv.Itoa(c.Ports[0].ContainerPort) {
				t.Errorf("ports %+v: want one port named http = %s's port %s", c.Ports, addrVar, port)
			}
			for _, p := range []struct {
				kind string
				p    *probe
				path string
			}{{"readiness", c.ReadinessProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/healthz"}} {
				if p.p == nil || p.p.HTTPGet == nil || p.p.HTTPGet.Path != p.path || p.p.HTTPGet.Port != "http" {
					t.Errorf("%s probe: want httpGet %s on port http", p.kind, p.path)
				}
			}

			// The proxy's spool directory is a volume of its own pod.
			if sub == "proxy" {
				dir := rc.env["SLUICE_USAGE_SPOOL_DIR"].value
				i := slices.IndexFunc(c.VolumeMounts, func(m volumeMount) bool { return m.MountPath == dir })
				if i < 0 {
					t.Fatalf("SLUICE_USAGE_SPOOL_DIR=%s is not a mounted volume (the root filesystem is read-only)", dir)
				}
				if !slices.ContainsFunc(rc.pod.Volumes, func(v volume) bool { return v.Name == c.VolumeMounts[i].Name }) {
					t.Errorf("volume %s is not declared", c.VolumeMounts[i].Name)
				}
			}
		})
	}
	for _, sub := range []string{"control", "proxy", "migrate"} {
		if !seen[sub] {
			t.Errorf("no manifest runs `sluice %s`", sub)
		}
	}
}

// TestDeploySecretsDocumented: every Secret key the manifests read is in
// deploy/README.md's table and in its `kubectl create secret` command.
func TestDeploySecretsDocumented(t *testing.T) {
	_, containers := renderKustomization(t)
	readme := string(readDeploy(t, "README.md"))
	for _, rc := range containers {
		for name, src := range rc.env {
			if !src.secret {
				continue
			}
			if !strings.Contains(readme, "| `"+name+"` |") {
				t.Errorf("%s: Secret key %s is not in deploy/README.md's secrets table", rc.obj, name)
			}
			if !strings.Contains(readme, "--from-literal="+name+"=") {
				t.Errorf("%s: Secret key %s is not in deploy/README.md's `kubectl create secret` command", rc.obj, name)
			}
		}
	}
}

// TestDockerfileBuild: the image is multi-stage, static, non-root, and its
// go build command is the Makefile's build-static recipe.
func TestDockerfileBuild(t *testing.T) {
	docker := string(readDeploy(t, "Dockerfile"))
	var froms []string
	var build, user, entry string
	for line := range strings.SplitSeq(docker, "\n") {
		switch {
		case strings.HasPrefix(line, "FROM "):
			froms = append(froms, line)
		case strings.HasPrefix(line, "RUN ") && strings.Contains(line, " go build "):
			build = strings.TrimPrefix(line, "RUN ")
		case strings.HasPrefix(line, "USER "):
			user = line
		case strings.HasPrefix(line, "ENTRYPOINT "):
			entry = line
		}
	}
	if len(froms) < 2 || !strings.Contains(froms[len(froms)-1], "distroless/static") {
		t.Errorf("want a multi-stage build ending on a distroless static base, got %q", froms)
	}
	if user != "USER 65532:65532" {
		t.Errorf("USER %q: want 65532:65532, the manifests' runAsUser", user)
	}
	if entry != `ENTRYPOINT ["/sluice"]` {
		t.Errorf("%q: the manifests run /sluice", entry)
	}
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	var recipe string
	lines := strings.Split(string(mk), "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "build-static:") && i+1 < len(lines) {
			recipe = strings.TrimSpace(lines[i+1])
		}
	}
	norm := func(s string) string {
		s = strings.ReplaceAll(s, "$(GO)", "go")
		return regexp.MustCompile(`-o \S+`).ReplaceAllString(s, "-o OUT")
	}
	if build == "" || recipe == "" || norm(build) != norm(recipe) {
		t.Errorf("Dockerfile builds with %q, Makefile build-static with %q: they must agree", build, recipe)
	}
	for _, want := range []string{"CGO_ENABLED=0 ", "./cmd/sluice", "./cmd/sluicectl"} {
		if !strings.Contains(build, want) {
			t.Errorf("Dockerfile build %q lacks %q", build, want)
		}
	}
	for _, want := range []string{"COPY --from=build /out/sluice /sluice", "COPY --from=build /out/sluicectl /sluicectl"} {
		if !strings.Contains(docker, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}

// argsNotAtDefault are manifest arguments that differ from the flag's
// default on purpose, with the reason.
var argsNotAtDefault = map[string]map[string]string{}

// TestDeployArgsAtDefaults: the manifests' arguments sit under "Settings
// that have no environment variable, at their defaults"; each must equal
// its flag's default (or be listed in argsNotAtDefault with the reason).
// --limit-slices=false stayed in the data plane's manifest when slices
// became the default, so a cluster ran exact admission only.
func TestDeployArgsAtDefaults(t *testing.T) {
	_, containers := renderKustomization(t)
	for _, rc := range containers {
		sub := rc.c.Command[len(rc.c.Command)-1]
		defs := map[string]string{}
		for _, f := range helpFlags(t, sub) {
			defs[f.name] = f.def
		}
		for _, a := range rc.args {
			name, v, ok := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if !ok {
				continue
			}
			def, known := defs[name]
			if !known || argsNotAtDefault[sub][name] != "" {
				continue
			}
			zero := def == "" && (v == "" || v == "false" || v == "0" || v == "0s")
			if !zero && !sameDefault(def, v) {
				t.Errorf("%s: `sluice %s` argument --%s=%s, its default is %q: set the default, or list it in argsNotAtDefault with the reason", rc.obj, sub, name, v, def)
			}
		}
	}
}
