package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	sigsyaml "sigs.k8s.io/yaml"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// The apply document format: a YAML stream of documents, each an object
// of one kind with its identity and its settable fields. Field names are
// the admin API's (snake_case); objects refer to each other by name, never
// by id, so one file describes a platform on any control plane.
//
//	kind: Org          name; limits, metadata
//	kind: Team         org, name; limits, metadata, traffic_class, model_group_aliases
//	kind: User         org, email; display_name, limits, metadata
//	kind: ModelGroup   name; description, platform_wide, granted_orgs (org names), routing (strategy,
//	                   session_ttl, load_factor), traffic (queues, prefill_isolation),
//	                   deployments (identified by api_base + upstream_model)
//	kind: Member, Customer, Key, OrgTraffic (apply_tenants.go)
//
// New kinds are added by a document type, a loader case in decodeDocument
// and a reconciler in apply.go.

// Document kinds.
const (
	kindOrg        = "Org"
	kindTeam       = "Team"
	kindUser       = "User"
	kindModelGroup = "ModelGroup"
)

// kinds are the document kinds in the order apply creates them (an org
// before its teams, model groups before the teams that alias them).
var kinds = []string{kindOrg, kindModelGroup, kindTeam, kindUser, kindMember, kindCustomer, kindKey, kindOrgTraffic}

// limitsDoc is adminv1.Limits in a document; unset fields are no limit.
type limitsDoc struct {
	MaxBudget           *float64           `yaml:"max_budget,omitempty"`
	BudgetDuration      string             `yaml:"budget_duration,omitempty"`
	SoftBudget          *float64           `yaml:"soft_budget,omitempty"`
	RpmLimit            *int64             `yaml:"rpm_limit,omitempty"`
	TpmLimit            *int64             `yaml:"tpm_limit,omitempty"`
	MaxParallelRequests *int64             `yaml:"max_parallel_requests,omitempty"`
	AllowedModels       []string           `yaml:"allowed_models,omitempty"`
	ModelMaxBudget      map[string]float64 `yaml:"model_max_budget,omitempty"`
	ModelRpmLimit       map[string]int64   `yaml:"model_rpm_limit,omitempty"`
	ModelTpmLimit       map[string]int64   `yaml:"model_tpm_limit,omitempty"`
	RateLimitFallback   string             `yaml:"rate_limit_fallback,omitempty"`
}

func (l *limitsDoc) proto() *adminv1.Limits {
	if l == nil {
		return nil
	}
	return &adminv1.Limits{
		MaxBudget: l.MaxBudget, BudgetDuration: l.BudgetDuration, SoftBudget: l.SoftBudget,
		RpmLimit: l.RpmLimit, TpmLimit: l.TpmLimit, MaxParallelRequests: l.MaxParallelRequests,
		AllowedModels: l.AllowedModels, ModelMaxBudget: l.ModelMaxBudget, ModelRpmLimit: l.ModelRpmLimit,
		ModelTpmLimit: l.ModelTpmLimit, RateLimitFallback: l.RateLimitFallback,
	}
}

func limitsFromProto(l *adminv1.Limits) *limitsDoc {
	if l == nil || isEmpty(l) {
		return nil
	}
	return &limitsDoc{
		MaxBudget: l.MaxBudget, BudgetDuration: l.BudgetDuration, SoftBudget: l.SoftBudget,
		RpmLimit: l.RpmLimit, TpmLimit: l.TpmLimit, MaxParallelRequests: l.MaxParallelRequests,
		AllowedModels: l.AllowedModels, ModelMaxBudget: l.ModelMaxBudget, ModelRpmLimit: l.ModelRpmLimit,
		ModelTpmLimit: l.ModelTpmLimit, RateLimitFallback: l.RateLimitFallback,
	}
}

// orgDoc is kind Org.
type orgDoc struct {
	Kind     string            `yaml:"kind"`
	Name     string            `yaml:"name"`
	Limits   *limitsDoc        `yaml:"limits,omitempty"`
	Metadata map[string]string `yaml:"metadata,omitempty"`
}

// teamDoc is kind Team.
type teamDoc struct {
	Kind              string            `yaml:"kind"`
	Org               string            `yaml:"org"`
	Name              string            `yaml:"name"`
	Limits            *limitsDoc        `yaml:"limits,omitempty"`
	Metadata          map[string]string `yaml:"metadata,omitempty"`
	TrafficClass      string            `yaml:"traffic_class,omitempty"`
	ModelGroupAliases map[string]string `yaml:"model_group_aliases,omitempty"`
}

// userDoc is kind User.
type userDoc struct {
	Kind        string            `yaml:"kind"`
	Org         string            `yaml:"org"`
	Email       string            `yaml:"email"`
	DisplayName string            `yaml:"display_name,omitempty"`
	Limits      *limitsDoc        `yaml:"limits,omitempty"`
	Metadata    map[string]string `yaml:"metadata,omitempty"`
}

// modelGroupDoc is kind ModelGroup with its deployments.
type modelGroupDoc struct {
	Kind        string `yaml:"kind"`
	Name        string `yaml:"name"`
	Description string `yaml:"description,omitempty"`
	// PlatformWide makes the group visible to every org; otherwise only
	// to the orgs it is granted to (sluicectl model-group grant;
	// docs/tenancy.md).
	PlatformWide bool `yaml:"platform_wide,omitempty"`
	// GrantedOrgs names the orgs the group is granted to. Omitted, the
	// group's grants are left as they are; listed, apply grants it to the
	// orgs it is not granted to yet and, with --prune, revokes the grants
	// of orgs the list leaves out (an empty list revokes every grant).
	GrantedOrgs *[]string   `yaml:"granted_orgs,omitempty"`
	Routing     *routingDoc `yaml:"routing,omitempty"`
	// Traffic, when set, replaces the group's traffic settings
	// (sluice.admin.v1.ModelGroupTraffic, decoded strictly by protojson:
	// queues, prefill_isolation), after the group's deployments are
	// applied (prefill_isolation must stay below their number); absent,
	// they are left as they are.
	Traffic     *trafficDoc     `yaml:"traffic,omitempty"`
	Deployments []deploymentDoc `yaml:"deployments,omitempty"`
}

// trafficProto decodes the group's traffic settings (nil: none set).
func (g *modelGroupDoc) trafficProto() (*adminv1.ModelGroupTraffic, error) {
	if g.Traffic == nil {
		return nil, nil
	}
	t := &adminv1.ModelGroupTraffic{}
	if err := g.Traffic.decode(t); err != nil {
		return nil, err
	}
	return t, nil
}

// routingDoc is a model group's routing settings (docs/routing.md,
// "Strategies"); session_ttl is a Go duration ("90m").
type routingDoc struct {
	Strategy   string  `yaml:"strategy,omitempty"`
	SessionTTL string  `yaml:"session_ttl,omitempty"`
	LoadFactor float64 `yaml:"load_factor,omitempty"`
}

// proto is the admin message of r (nil when nothing is set).
func (r *routingDoc) proto() (*adminv1.ModelGroupRouting, error) {
	if r == nil {
		return nil, nil
	}
	m := &adminv1.ModelGroupRouting{Strategy: r.Strategy, LoadFactor: r.LoadFactor}
	if r.SessionTTL != "" {
		d, err := time.ParseDuration(r.SessionTTL)
		if err != nil {
			return nil, fmt.Errorf("routing.session_ttl %q: want a duration, e.g. 90m", r.SessionTTL)
		}
		m.SessionTtl = durationpb.New(d)
	}
	return nonEmptyRouting(m), nil
}

// routingDocOf is the document form of m (nil when nothing is set).
func routingDocOf(m *adminv1.ModelGroupRouting) *routingDoc {
	if nonEmptyRouting(m) == nil {
		return nil
	}
	r := &routingDoc{Strategy: m.GetStrategy(), LoadFactor: m.GetLoadFactor()}
	if d := m.GetSessionTtl(); d != nil {
		r.SessionTTL = d.AsDuration().String()
	}
	return r
}

// deploymentDoc is one deployment of a model group, identified in its
// group by api_base and upstream_model.
type deploymentDoc struct {
	APIBase        string           `yaml:"api_base"`
	UpstreamModel  string           `yaml:"upstream_model"`
	Weight         int32            `yaml:"weight,omitempty"`
	MaxConcurrency int64            `yaml:"max_concurrency,omitempty"`
	Capabilities   *capabilitiesDoc `yaml:"capabilities,omitempty"`
	Tags           []string         `yaml:"tags,omitempty"`
	Prices         *pricesDoc       `yaml:"prices,omitempty"`
	Free           bool             `yaml:"free,omitempty"`
	Credential     *credentialDoc   `yaml:"credential,omitempty"`
	// Traffic, when set, replaces the deployment's traffic settings
	// (sluice.admin.v1.DeploymentTraffic, decoded strictly by protojson:
	// interactive_reserve, batch_max_concurrency,
	// max_prefill_tokens_in_flight, priority_scheduling, class_priority,
	// queues); absent, they are left as they are.
	Traffic *trafficDoc `yaml:"traffic,omitempty"`
}

// trafficDoc keeps a document's traffic settings as YAML, decoded by
// protojson (strictly) when planned.
type trafficDoc struct{ node yaml.Node }

// UnmarshalYAML keeps the node.
func (t *trafficDoc) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: traffic: want a mapping", n.Line)
	}
	t.node = *n
	return nil
}

// MarshalYAML writes the kept node (get -o yaml).
func (t *trafficDoc) MarshalYAML() (any, error) { return &t.node, nil }

// trafficDocOf is the document form of a deployment's traffic settings
// (nil when nothing is set): their protojson (proto field names, what
// trafficProto decodes) as YAML, with protojson's quoted int64 values
// written as integers (DeploymentTraffic has no free-form string field:
// its strings are enum names and durations).
func trafficDocOf(t *adminv1.DeploymentTraffic) (*trafficDoc, error) {
	if t == nil || isEmpty(t) {
		return nil, nil
	}
	j, err := compareJSON.Marshal(t)
	if err != nil {
		return nil, err
	}
	var n yaml.Node
	if err := yaml.Unmarshal(j, &n); err != nil {
		return nil, err
	}
	var plain func(*yaml.Node)
	plain = func(n *yaml.Node) {
		n.Style = 0 // block style, unquoted where YAML allows
		if n.Kind == yaml.ScalarNode && n.Tag == "!!str" {
			if _, err := strconv.ParseInt(n.Value, 10, 64); err == nil {
				n.Tag = "!!int"
			}
		}
		for _, c := range n.Content {
			plain(c)
		}
	}
	plain(&n)
	if n.Kind != yaml.DocumentNode || len(n.Content) != 1 {
		return nil, fmt.Errorf("traffic: unexpected YAML of %s", j)
	}
	return &trafficDoc{node: *n.Content[0]}, nil
}

// trafficProto decodes the document's traffic settings (nil: none set).
func (d *deploymentDoc) trafficProto() (*adminv1.DeploymentTraffic, error) {
	if d.Traffic == nil {
		return nil, nil
	}
	t := &adminv1.DeploymentTraffic{}
	if err := d.Traffic.decode(t); err != nil {
		return nil, err
	}
	return t, nil
}

// decode decodes the settings into m (protojson, strictly).
func (t *trafficDoc) decode(m proto.Message) error {
	var v any
	if err := t.node.Decode(&v); err != nil {
		return fmt.Errorf("traffic: %w", err)
	}
	y, err := yaml.Marshal(v)
	if err != nil {
		return fmt.Errorf("traffic: %w", err)
	}
	j, err := sigsyaml.YAMLToJSON(y)
	if err != nil {
		return fmt.Errorf("traffic: %w", err)
	}
	if err := protojson.Unmarshal(j, m); err != nil {
		return fmt.Errorf("traffic: %w", err)
	}
	return nil
}

type capabilitiesDoc struct {
	Tools           bool  `yaml:"tools,omitempty"`
	JSONMode        bool  `yaml:"json_mode,omitempty"`
	Vision          bool  `yaml:"vision,omitempty"`
	MaxInputTokens  int64 `yaml:"max_input_tokens,omitempty"`
	MaxOutputTokens int64 `yaml:"max_output_tokens,omitempty"`
}

type pricesDoc struct {
	InputPerToken       float64 `yaml:"input_per_token,omitempty"`
	OutputPerToken      float64 `yaml:"output_per_token,omitempty"`
	CachedInputPerToken float64 `yaml:"cached_input_per_token,omitempty"`
}

// credentialDoc says where a deployment's upstream credential comes
// from: valueFrom (an environment variable or a file read by sluicectl),
// or stored: true (keep the credential the control plane holds; `get`
// writes this, as the value is never returned). Credentials are never
// written inline.
type credentialDoc struct {
	ValueFrom *valueFrom `yaml:"valueFrom,omitempty"`
	Stored    bool       `yaml:"stored,omitempty"`
}

// UnmarshalYAML refuses an inline credential without echoing it.
func (c *credentialDoc) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: credential: inline values are not accepted: use valueFrom: {env: NAME} or {file: PATH}", n.Line)
	}
	// n.Decode does not reject unknown fields, so the two levels are
	// checked here.
	if err := knownKeys(n, "credential", "valueFrom", "stored"); err != nil {
		return err
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == "valueFrom" {
			if err := knownKeys(n.Content[i+1], "credential.valueFrom", "env", "file"); err != nil {
				return err
			}
		}
	}
	type plain credentialDoc
	return n.Decode((*plain)(c))
}

// knownKeys fails on a key of mapping n that is not one of keys.
func knownKeys(n *yaml.Node, what string, keys ...string) error {
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: %s: want a mapping", n.Line, what)
	}
	for i := 0; i < len(n.Content); i += 2 {
		if k := n.Content[i]; !slices.Contains(keys, k.Value) {
			return fmt.Errorf("line %d: field %s not found in %s (fields: %s)", k.Line, k.Value, what, strings.Join(keys, ", "))
		}
	}
	return nil
}

type valueFrom struct {
	Env  string `yaml:"env,omitempty"`
	File string `yaml:"file,omitempty"`
}

// describe says where the credential comes from, never its value.
func (c *credentialDoc) describe() string {
	switch {
	case c == nil:
		return "none"
	case c.Stored:
		return "stored"
	case c.ValueFrom.Env != "":
		return "from env " + c.ValueFrom.Env
	}
	return "from file " + c.ValueFrom.File
}

func (c *credentialDoc) validate() error {
	if c == nil {
		return nil
	}
	switch {
	case c.Stored && c.ValueFrom != nil:
		return errors.New("credential: give valueFrom or stored: true, not both")
	case c.Stored:
		return nil
	case c.ValueFrom == nil:
		return errors.New("credential: give valueFrom: {env: NAME} or {file: PATH}, or stored: true (inline values are not accepted)")
	case (c.ValueFrom.Env == "") == (c.ValueFrom.File == ""):
		return errors.New("credential.valueFrom: give exactly one of env or file")
	}
	return nil
}

// read resolves a valueFrom credential.
func (c *credentialDoc) read(getenv func(string) string) (string, error) {
	if c.ValueFrom.Env != "" {
		v := getenv(c.ValueFrom.Env)
		if v == "" {
			return "", fmt.Errorf("credential.valueFrom.env %s: the variable is empty or unset", c.ValueFrom.Env)
		}
		return v, nil
	}
	b, err := os.ReadFile(c.ValueFrom.File)
	if err != nil {
		return "", fmt.Errorf("credential.valueFrom.file: %w", err)
	}
	v := strings.TrimRight(string(b), "\r\n")
	if v == "" {
		return "", fmt.Errorf("credential.valueFrom.file %s is empty", c.ValueFrom.File)
	}
	return v, nil
}

func (d *deploymentDoc) identity() string { return d.APIBase + " " + d.UpstreamModel }

// proto is the deployment's settable fields as the API returns them
// (weight 0 is the server's default of 1).
func (d *deploymentDoc) proto(group string) *adminv1.Deployment {
	out := &adminv1.Deployment{ModelGroup: group, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		Weight: d.Weight, MaxConcurrency: d.MaxConcurrency, Tags: d.Tags, Free: d.Free}
	if out.Weight == 0 {
		out.Weight = 1
	}
	if c := d.Capabilities; c != nil {
		out.Capabilities = &adminv1.Capabilities{Tools: c.Tools, JsonMode: c.JSONMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens}
	}
	if p := d.Prices; p != nil {
		out.Prices = &adminv1.Prices{InputPerToken: p.InputPerToken, OutputPerToken: p.OutputPerToken, CachedInputPerToken: p.CachedInputPerToken}
	}
	return out
}

func deploymentFromProto(d *adminv1.Deployment) deploymentDoc {
	out := deploymentDoc{APIBase: d.GetApiBase(), UpstreamModel: d.GetUpstreamModel(), Weight: d.GetWeight(),
		MaxConcurrency: d.GetMaxConcurrency(), Tags: d.GetTags(), Free: d.GetFree()}
	if out.Weight == 1 {
		out.Weight = 0
	}
	if c := d.GetCapabilities(); c != nil && !isEmpty(c) {
		out.Capabilities = &capabilitiesDoc{Tools: c.Tools, JSONMode: c.JsonMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens}
	}
	if p := d.GetPrices(); p != nil && !isEmpty(p) {
		out.Prices = &pricesDoc{InputPerToken: p.InputPerToken, OutputPerToken: p.OutputPerToken, CachedInputPerToken: p.CachedInputPerToken}
	}
	if d.GetHasCredential() {
		out.Credential = &credentialDoc{Stored: true}
	}
	return out
}

// docSet is the decoded file: every document by kind, in file order.
type docSet struct {
	orgs   []*orgDoc
	teams  []*teamDoc
	users  []*userDoc
	groups []*modelGroupDoc
	// members, customers, keys and org traffic (apply_tenants.go)
	tenantDocs
	// covered are the kinds the file has at least one document of.
	covered map[string]bool
}

// typeName matches yaml.v3's Go type names in errors ("in type
// main.teamDoc"); badValue the value it quotes, which is never echoed (it
// may be a secret in the wrong place).
var (
	typeName = regexp.MustCompile(` in type \S+`)
	badValue = regexp.MustCompile("cannot unmarshal !!(\\w+) `[^`]*` into main\\.(\\w+?)(Doc)?$")
)

// decodeDocuments reads a YAML stream of apply documents. An unknown
// field, a missing kind or identity, or a duplicate object is an error
// naming the document (its number and kind) and the field.
func decodeDocuments(r io.Reader) (*docSet, error) {
	dec := yaml.NewDecoder(r)
	set := &docSet{covered: map[string]bool{}}
	seen := map[string]int{}
	var errs []error
	for n := 1; ; n++ {
		var node yaml.Node
		err := dec.Decode(&node)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", n, err)
		}
		if len(node.Content) == 0 || (node.Content[0].Kind == yaml.ScalarNode && node.Content[0].Tag == "!!null") {
			continue // an empty document ("---" at the end)
		}
		id, err := set.decodeDocument(&node)
		if err != nil {
			errs = append(errs, fmt.Errorf("document %d: %w", n, err))
			continue
		}
		if prev, ok := seen[id]; ok {
			errs = append(errs, fmt.Errorf("document %d: %s is already declared in document %d", n, id, prev))
			continue
		}
		seen[id] = n
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return set, nil
}

// decodeStrict decodes node into v, rejecting unknown fields.
func decodeStrict(node *yaml.Node, v any, kind string) error {
	b, err := yaml.Marshal(node)
	if err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	err = dec.Decode(v)
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs := make([]string, len(te.Errors))
		for i, m := range te.Errors {
			msgs[i] = badValue.ReplaceAllString(typeName.ReplaceAllString(m, " in "+kind), "wrong type: a $1 where $2 is expected")
		}
		return errors.New(strings.Join(msgs, "; "))
	}
	return err
}

// decodeDocument decodes one document by its kind and returns its
// identity ("Team acme/agents").
func (s *docSet) decodeDocument(node *yaml.Node) (string, error) {
	var head struct {
		Kind string `yaml:"kind"`
	}
	if err := node.Decode(&head); err != nil {
		return "", fmt.Errorf("not a mapping with a kind: %w", err)
	}
	need := func(field, v string) error {
		if strings.TrimSpace(v) == "" {
			return fmt.Errorf("%s: %s is required", head.Kind, field)
		}
		return nil
	}
	switch head.Kind {
	case kindOrg:
		d := &orgDoc{}
		if err := decodeStrict(node, d, head.Kind); err != nil {
			return "", err
		}
		if err := need("name", d.Name); err != nil {
			return "", err
		}
		s.orgs = append(s.orgs, d)
		s.covered[head.Kind] = true
		return "Org " + d.Name, nil
	case kindTeam:
		d := &teamDoc{}
		if err := decodeStrict(node, d, head.Kind); err != nil {
			return "", err
		}
		if err := errors.Join(need("org", d.Org), need("name", d.Name)); err != nil {
			return "", err
		}
		if d.TrafficClass != "" {
			if _, err := parseTrafficClass(d.TrafficClass); err != nil {
				return "", fmt.Errorf("Team %s/%s: traffic_class: %w", d.Org, d.Name, err) //nolint:staticcheck // ST1005: "Team" is the document kind as written in the file
			}
		}
		s.teams = append(s.teams, d)
		s.covered[head.Kind] = true
		return "Team " + d.Org + "/" + d.Name, nil
	case kindUser:
		d := &userDoc{}
		if err := decodeStrict(node, d, head.Kind); err != nil {
			return "", err
		}
		if err := errors.Join(need("org", d.Org), need("email", d.Email)); err != nil {
			return "", err
		}
		d.Email = strings.ToLower(d.Email) // the server keeps e-mails lower-cased
		s.users = append(s.users, d)
		s.covered[head.Kind] = true
		return "User " + d.Org + "/" + d.Email, nil
	case kindModelGroup:
		d := &modelGroupDoc{}
		if err := decodeStrict(node, d, head.Kind); err != nil {
			return "", err
		}
		if err := need("name", d.Name); err != nil {
			return "", err
		}
		if d.GrantedOrgs != nil {
			seen := map[string]bool{}
			for i, o := range *d.GrantedOrgs {
				if strings.TrimSpace(o) == "" {
					return "", fmt.Errorf("ModelGroup %s: granted_orgs[%d]: an org name is required", d.Name, i)
				}
				if seen[o] {
					return "", fmt.Errorf("ModelGroup %s: granted_orgs[%d]: org %s is listed twice", d.Name, i, o)
				}
				seen[o] = true
			}
		}
		ids := map[string]bool{}
		for i := range d.Deployments {
			dep := &d.Deployments[i]
			if err := errors.Join(need("deployments[].api_base", dep.APIBase), need("deployments[].upstream_model", dep.UpstreamModel)); err != nil {
				return "", err
			}
			if ids[dep.identity()] {
				return "", fmt.Errorf("ModelGroup %s: deployments[%d]: api_base %s with upstream_model %s is listed twice", d.Name, i, dep.APIBase, dep.UpstreamModel)
			}
			ids[dep.identity()] = true
			if err := dep.Credential.validate(); err != nil {
				return "", fmt.Errorf("ModelGroup %s: deployments[%d]: %w", d.Name, i, err)
			}
		}
		s.groups = append(s.groups, d)
		s.covered[head.Kind] = true
		return "ModelGroup " + d.Name, nil
	case "":
		return "", errors.New("kind is required (one of " + strings.Join(kinds, ", ") + ")")
	}
	if id, ok, err := s.decodeTenantDocument(head.Kind, node); ok {
		return id, err
	}
	return "", fmt.Errorf("unknown kind %q (kinds: %s)", head.Kind, strings.Join(kinds, ", "))
}

// parseTrafficClass parses a traffic class name (interactive, agent, batch).
func parseTrafficClass(s string) (adminv1.TrafficClass, error) {
	var tc adminv1.TrafficClass
	err := (&trafficClassValue{&tc}).Set(s)
	return tc, err
}

// encodeDocuments writes docs as a YAML stream, each document opened by
// "---" so that the output of several commands concatenates into one
// valid stream.
func encodeDocuments(w io.Writer, docs []any) error {
	for _, d := range docs {
		var buf bytes.Buffer
		buf.WriteString("---\n")
		enc := yaml.NewEncoder(&buf)
		enc.SetIndent(2)
		if err := enc.Encode(d); err != nil {
			return fmt.Errorf("encode yaml: %w", err)
		}
		if err := enc.Close(); err != nil {
			return fmt.Errorf("encode yaml: %w", err)
		}
		if _, err := w.Write(buf.Bytes()); err != nil {
			return err
		}
	}
	return nil
}
