package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var modelGroupColumns = []column[*adminv1.ModelGroup]{
	{"NAME", (*adminv1.ModelGroup).GetName},
	{"DESCRIPTION", (*adminv1.ModelGroup).GetDescription},
	{"PLATFORM-WIDE", func(g *adminv1.ModelGroup) string { return yesNo(g.GetPlatformWide()) }},
	{"GRANTED TO", func(g *adminv1.ModelGroup) string { return strings.Join(g.GetGrantedOrgIds(), ",") }},
	{"FALLBACKS", func(g *adminv1.ModelGroup) string { return strings.Join(g.GetFallbacks(), ",") }},
	{"CREATED", func(g *adminv1.ModelGroup) string { return formatTime(g.GetCreateTime()) }},
}

var grantColumns = []column[*adminv1.ModelGroupGrant]{
	{"MODEL GROUP", (*adminv1.ModelGroupGrant).GetModelGroup},
	{"ORG", (*adminv1.ModelGroupGrant).GetOrgId},
	{"GRANTED BY", (*adminv1.ModelGroupGrant).GetCreatedBy},
	{"CREATED", func(g *adminv1.ModelGroupGrant) string { return formatTime(g.GetCreateTime()) }},
}

var deploymentColumns = []column[*adminv1.Deployment]{
	{"ID", (*adminv1.Deployment).GetId},
	{"GROUP", (*adminv1.Deployment).GetModelGroup},
	{"API BASE", (*adminv1.Deployment).GetApiBase},
	{"UPSTREAM MODEL", (*adminv1.Deployment).GetUpstreamModel},
	{"WEIGHT", func(d *adminv1.Deployment) string { return strconv.Itoa(int(d.GetWeight())) }},
	{"MAX CONC", func(d *adminv1.Deployment) string { return strconv.FormatInt(d.GetMaxConcurrency(), 10) }},
	{"PRICES/1M (IN/OUT)", pricesSummary},
	{"TAGS", func(d *adminv1.Deployment) string { return strings.Join(d.GetTags(), ",") }},
	{"CREDENTIAL", func(d *adminv1.Deployment) string { return yesNo(d.GetHasCredential()) }},
}

// pricesSummary shows prices per million tokens, as price lists do.
func pricesSummary(d *adminv1.Deployment) string {
	if d.GetFree() {
		return "free"
	}
	per := func(v float64) string { return "$" + strconv.FormatFloat(v*1e6, 'g', 6, 64) }
	s := per(d.GetPrices().GetInputPerToken()) + "/" + per(d.GetPrices().GetOutputPerToken())
	if c := d.GetPrices().GetCachedInputPerToken(); c > 0 {
		s += " (cached " + per(c) + ")"
	}
	return s
}

func modelGroupCommand() *command {
	return group("model-group", "manage model groups (the names clients ask for)", []*command{
		leaf("create", "NAME", "create a model group", runModelGroupCreate),
		oneArgCommand("get", "NAME", "show a model group", func(ctx context.Context, cl *clients, name string) (proto.Message, error) {
			r, err := call(ctx, cl.models.GetModelGroup, &adminv1.GetModelGroupRequest{Name: name})
			return r.GetModelGroup(), err
		}),
		listCommand("", "list model groups", modelGroupColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.ModelGroup] {
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.ModelGroup, string, error) {
				r, err := call(ctx, c.models.ListModelGroups, &adminv1.ListModelGroupsRequest{PageSize: size, PageToken: tok})
				return r.GetModelGroups(), r.GetNextPageToken(), err
			}
		}),
		leaf("update", "NAME", "change the fields given as flags", runModelGroupUpdate),
		deleteByCommand("model group", "NAME", "delete a model group (it must have no deployments)", func(ctx context.Context, cl *clients, name string) (proto.Message, error) {
			return call(ctx, cl.models.DeleteModelGroup, &adminv1.DeleteModelGroupRequest{Name: name})
		}),
		leaf("grant", "NAME ORG_ID", "let an org see and call the group (platform tokens)", runModelGroupGrant),
		leaf("revoke", "NAME ORG_ID", "take a grant away: the org's requests for the group stop at once (platform tokens)", runModelGroupRevoke),
		renamed("grants", listCommand("", "list grants (of one group with --model-group, of one org with --org)", grantColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.ModelGroupGrant] {
			req := &adminv1.ListModelGroupGrantsRequest{}
			fs.StringVar(&req.ModelGroup, "model-group", "", "only grants of this model group")
			fs.StringVar(&req.OrgId, "org", "", "only grants to this org")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.ModelGroupGrant, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.models.ListModelGroupGrants, req)
				return r.GetGrants(), r.GetNextPageToken(), err
			}
		})),
	}, "model-groups", "mg")
}

// modelGroupFields registers the settable fields of a model group.
func modelGroupFields(f *fields, g *adminv1.ModelGroup) {
	if g.Resilience == nil {
		g.Resilience = &adminv1.ModelGroupResilience{}
	}
	r := g.Resilience
	f.String(&g.Description, "description", "description", "what the group serves")
	f.List(&g.Fallbacks, "fallbacks", "fallbacks", "ordered fallback model groups, comma-separated (docs/resilience.md)")
	f.add("ttft-timeout-ms", "resilience.ttft_timeout_ms", (*int64Value)(&r.TtftTimeoutMs), "TTFT deadline of stream attempts in ms (0: the proxy's --ttft-timeout)")
	f.add("ejection-base-ms", "resilience.ejection_base_ms", (*int64Value)(&r.EjectionBaseMs), "first ejection of a failing deployment in ms (0: the proxy's --ejection-base)")
	f.add("ejection-max-ms", "resilience.ejection_max_ms", (*int64Value)(&r.EjectionMaxMs), "longest ejection in ms (0: the proxy's --ejection-max)")
	f.add("max-attempts", "resilience.max_attempts", (*int32Value)(&r.MaxAttempts), "most upstream attempts per request, retries and fallbacks together (0: 1 + the proxy's --max-retries)")
	f.add("panic-threshold", "resilience.panic_threshold_percent", (*int32Value)(&r.PanicThresholdPercent), "route to the whole pool when more than this percent is out (0: the proxy's --panic-threshold)")
}

func runModelGroupCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	g := &adminv1.ModelGroup{Routing: &adminv1.ModelGroupRouting{}}
	fs.StringVar(&g.Name, "name", "", "name clients ask for: 1–100 characters of [A-Za-z0-9._:/-]")
	f := newFields(fs)
	modelGroupFields(f, g)
	fs.BoolVar(&g.PlatformWide, "platform-wide", false, "visible to every org (otherwise only to the orgs it is granted to)")
	routingFields(f, g.Routing)
	if err := a.parseNamed(fs, c, &g.Name, "name"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	req := &adminv1.CreateModelGroupRequest{Name: g.Name, Description: g.Description, PlatformWide: g.PlatformWide,
		Routing: nonEmptyRouting(g.Routing), Fallbacks: g.Fallbacks}
	if proto.Size(g.Resilience) > 0 {
		req.Resilience = g.Resilience
	}
	r, err := call(ctx, cl.models.CreateModelGroup, req)
	return p.result(r.GetModelGroup(), err)
}

func runModelGroupGrant(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	pos, cl, p, err := a.parseConnect(fs, c, 2, 2)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.models.GrantModelGroup, &adminv1.GrantModelGroupRequest{ModelGroup: pos[0], OrgId: pos[1]})
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	return list(p, []*adminv1.ModelGroupGrant{r.GetGrant()}, grantColumns)
}

func runModelGroupRevoke(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	pos, cl, p, err := a.parseConnect(fs, c, 2, 2)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.models.RevokeModelGroup, &adminv1.RevokeModelGroupRequest{ModelGroup: pos[0], OrgId: pos[1]})
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	_, err = fmt.Fprintf(p.w, "revoked: org %s may no longer use model group %s\n", pos[1], pos[0])
	return err
}

func runModelGroupUpdate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	g := &adminv1.ModelGroup{Routing: &adminv1.ModelGroupRouting{}}
	f := newFields(fs)
	modelGroupFields(f, g)
	f.add("platform-wide", "platform_wide", (*boolValue)(&g.PlatformWide), "visible to every org; --platform-wide=false takes it away from orgs without a grant")
	routingFields(f, g.Routing)
	f.Clearable()
	pos, err := a.parse(fs, c, 1, 1)
	if err != nil {
		return err
	}
	mask, err := f.updateMask()
	if err != nil {
		return err
	}
	g.Name = pos[0]
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.models.UpdateModelGroup, &adminv1.UpdateModelGroupRequest{ModelGroup: g, UpdateMask: mask})
	return p.result(r.GetModelGroup(), err)
}

// routingFields registers the flags of a model group's routing settings
// (docs/routing.md, "Strategies").
func routingFields(f *fields, r *adminv1.ModelGroupRouting) {
	f.String(&r.Strategy, "strategy", "routing.strategy",
		"routing `STRATEGY`: weighted_shuffle, affinity, least_outstanding or engine_load (empty: the defaults by traffic class)")
	f.Duration(&r.SessionTtl, "session-ttl", "routing.session_ttl", "how long a session pin lives after its last use (default 1h; affinity only)")
	f.FloatValue(&r.LoadFactor, "load-factor", "routing.load_factor", "bounded-load factor c, 1–10 (default 1.25; affinity only)")
}

// nonEmptyRouting is r, or nil when nothing is set.
func nonEmptyRouting(r *adminv1.ModelGroupRouting) *adminv1.ModelGroupRouting {
	if r == nil || proto.Size(r) == 0 {
		return nil
	}
	return r
}

func deploymentCommand() *command {
	return group("deployment", "manage deployments (upstream engines of model groups)", []*command{
		leaf("create", "", "create a deployment", runDeploymentCreate),
		idCommand("get", "DEPLOYMENT", "show a deployment", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.models.GetDeployment, &adminv1.GetDeploymentRequest{Id: id})
			return r.GetDeployment(), err
		}),
		listCommand("", "list deployments", deploymentColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Deployment] {
			req := &adminv1.ListDeploymentsRequest{}
			fs.StringVar(&req.ModelGroup, "model-group", "", "only deployments of this model group")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Deployment, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.models.ListDeployments, req)
				return r.GetDeployments(), r.GetNextPageToken(), err
			}
		}),
		leaf("update", "DEPLOYMENT_ID", "change the fields given as flags (--clear FLAG resets one)", runDeploymentUpdate),
		deleteCommand("deployment", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.models.DeleteDeployment, &adminv1.DeleteDeploymentRequest{Id: id})
		}),
	}, "deployments", "dep")
}

// deploymentFields registers the settable fields of a deployment.
func deploymentFields(f *fields, d *adminv1.Deployment) {
	if d.Capabilities == nil {
		d.Capabilities = &adminv1.Capabilities{}
	}
	if d.Prices == nil {
		d.Prices = &adminv1.Prices{}
	}
	f.String(&d.ApiBase, "api-base", "api_base", "base URL of the OpenAI-compatible upstream, e.g. http://vllm-a:8000/v1")
	f.String(&d.UpstreamModel, "upstream-model", "upstream_model", "model name sent upstream")
	f.add("weight", "weight", (*int32Value)(&d.Weight), "relative weight in the weighted shuffle, 1–1000 (default 1)")
	f.add("max-concurrency", "max_concurrency", (*int64Value)(&d.MaxConcurrency), "most requests in flight at this deployment (0: no cap)")
	caps := d.Capabilities
	f.add("tools", "capabilities.tools", (*boolValue)(&caps.Tools), "accepts tools / tool_choice")
	f.add("json-mode", "capabilities.json_mode", (*boolValue)(&caps.JsonMode), "accepts response_format (JSON mode)")
	f.add("vision", "capabilities.vision", (*boolValue)(&caps.Vision), "accepts image content")
	f.add("max-input-tokens", "capabilities.max_input_tokens", (*int64Value)(&caps.MaxInputTokens), "largest prompt in tokens (0: not filtered)")
	f.add("max-output-tokens", "capabilities.max_output_tokens", (*int64Value)(&caps.MaxOutputTokens), "largest max_tokens (0: no limit)")
	f.List(&d.Tags, "tags", "tags", "pool tags, comma-separated (untagged deployments form the default pool)")
	pr := d.Prices
	f.add("input-price", "prices.input_per_token", (*priceValue)(&pr.InputPerToken), "USD per prompt token, e.g. 0.0000002 ($0.20 per million)")
	f.add("output-price", "prices.output_per_token", (*priceValue)(&pr.OutputPerToken), "USD per completion token")
	f.add("cached-input-price", "prices.cached_input_per_token", (*priceValue)(&pr.CachedInputPerToken), "USD per prompt token served from the prefix cache (0: the input price)")
	f.add("free", "free", (*boolValue)(&d.Free), "declare the deployment free (required instead of prices)")
}

// credentialFlags registers where an upstream credential is read from:
// never a flag value, which would show in process listings and history.
type credentialFlags struct {
	file, env string
}

func (cf *credentialFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&cf.file, "credential-file", "", "read the upstream bearer credential from this file (\"-\": standard input)")
	fs.StringVar(&cf.env, "credential-env", "", "read the upstream bearer credential from this environment variable")
}

// read returns the credential and whether one was given.
func (cf *credentialFlags) read(a *app) (string, bool, error) {
	switch {
	case cf.file != "" && cf.env != "":
		return "", false, errors.New("give --credential-file or --credential-env, not both")
	case cf.env != "":
		v := a.getenv(cf.env)
		if v == "" {
			return "", false, fmt.Errorf("--credential-env %s: the variable is empty or unset", cf.env)
		}
		return v, true, nil
	case cf.file != "":
		var b []byte
		var err error
		if cf.file == "-" {
			b, err = io.ReadAll(io.LimitReader(os.Stdin, 1<<20))
		} else {
			b, err = os.ReadFile(cf.file)
		}
		if err != nil {
			return "", false, fmt.Errorf("--credential-file: %w", err)
		}
		v := strings.TrimRight(string(b), "\r\n")
		if v == "" {
			return "", false, fmt.Errorf("--credential-file %s is empty", cf.file)
		}
		return v, true, nil
	}
	return "", false, nil
}

func runDeploymentCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	d := &adminv1.Deployment{}
	fs.StringVar(&d.ModelGroup, "model-group", "", "model group the deployment serves (required)")
	deploymentFields(newFields(fs), d)
	var cf credentialFlags
	cf.register(fs)
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	cred, _, err := cf.read(a)
	if err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.models.CreateDeployment, &adminv1.CreateDeploymentRequest{
		ModelGroup: d.ModelGroup, ApiBase: d.ApiBase, UpstreamModel: d.UpstreamModel, Credential: cred,
		Weight: d.Weight, MaxConcurrency: d.MaxConcurrency, Capabilities: d.Capabilities, Tags: d.Tags,
		Prices: d.Prices, Free: d.Free,
	})
	return p.result(r.GetDeployment(), err)
}

func runDeploymentUpdate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	d := &adminv1.Deployment{}
	f := newFields(fs)
	deploymentFields(f, d)
	f.Clearable()
	var cf credentialFlags
	cf.register(fs)
	remove := fs.Bool("remove-credential", false, "remove the upstream credential")
	pos, err := a.parse(fs, c, 1, 1)
	if err != nil {
		return err
	}
	cred, setCred, err := cf.read(a)
	if err != nil {
		return err
	}
	if setCred && *remove {
		return errors.New("give a new credential or --remove-credential, not both")
	}
	mask := &fieldmaskpb.FieldMask{}
	if !(setCred || *remove) || f.anyGiven() {
		if mask, err = f.updateMask(); err != nil {
			return err
		}
	}
	if setCred || *remove {
		mask.Paths = append(mask.Paths, "credential")
	}
	d.Id = pos[0]
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.models.UpdateDeployment, &adminv1.UpdateDeploymentRequest{Deployment: d, UpdateMask: mask, Credential: cred})
	return p.result(r.GetDeployment(), err)
}

// anyGiven reports whether a field flag or --clear was given.
func (f *fields) anyGiven() bool {
	given := len(f.clear.values()) > 0
	f.fs.Visit(func(fl *flag.Flag) {
		if _, ok := f.paths[fl.Name]; ok {
			given = true
		}
	})
	return given
}

// int32Value is a plain int32 flag.
type int32Value int32

func (v *int32Value) String() string { return strconv.Itoa(int(*v)) }
func (v *int32Value) Set(s string) error {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 32)
	if err != nil {
		return errors.New("want a whole number")
	}
	*v = int32Value(n)
	return nil
}

// int64Value is a plain int64 flag.
type int64Value int64

func (v *int64Value) String() string { return strconv.FormatInt(int64(*v), 10) }
func (v *int64Value) Set(s string) error {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return errors.New("want a whole number")
	}
	*v = int64Value(n)
	return nil
}

// priceValue is a USD-per-token price.
type priceValue float64

func (v *priceValue) String() string { return strconv.FormatFloat(float64(*v), 'g', -1, 64) }
func (v *priceValue) Set(s string) error {
	n, err := parseNumber(s)
	if err != nil {
		return err
	}
	*v = priceValue(n)
	return nil
}

// boolValue is a boolean flag ("--tools", "--tools=false").
type boolValue bool

func (v *boolValue) IsBoolFlag() bool { return true }
func (v *boolValue) String() string   { return strconv.FormatBool(bool(*v)) }
func (v *boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("want true or false")
	}
	*v = boolValue(b)
	return nil
}

func (*int32Value) placeholder() string { return "N" }
func (*int64Value) placeholder() string { return "N" }
func (*priceValue) placeholder() string { return "USD" }
