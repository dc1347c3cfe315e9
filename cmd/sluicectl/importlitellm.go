package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

func importCommand() *command {
	return group("import", "translate another gateway's configuration into apply documents", []*command{
		leaf("litellm", "CONFIG_YAML", "translate a LiteLLM config.yaml (and --teams export) into apply documents on stdout; the trap report goes to stderr", runImportLiteLLM),
	})
}

func runImportLiteLLM(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	teams := fs.String("teams", "", "a LiteLLM team export (JSON array of /team/list or /team/info objects) to import as teams")
	keys := fs.String("keys", "", "a LiteLLM key export (JSON array of /key/list or /key/info objects): reported with the equivalent 'sluicectl key create' (tokens cannot be carried over)")
	org := fs.String("org", "imported", "org the imported teams and budgets go to (LiteLLM has one proxy-wide scope)")
	report := fs.String("report", "", "write the trap report to this file instead of standard error")
	pos, err := a.parse(fs, c, 1, 1)
	if err != nil {
		return err
	}
	cfg, err := os.ReadFile(pos[0])
	if err != nil {
		return err
	}
	var teamJSON []byte
	if *teams != "" {
		if teamJSON, err = os.ReadFile(*teams); err != nil {
			return err
		}
	}
	res, err := importLiteLLM(cfg, teamJSON, *org)
	if err != nil {
		return err
	}
	if *keys != "" {
		b, err := os.ReadFile(*keys)
		if err != nil {
			return err
		}
		if err := res.importKeys(b, teamJSON, *org); err != nil {
			return err
		}
	}
	if err := encodeDocuments(a.stdout, res.docs); err != nil {
		return err
	}
	w := a.stderr
	if *report != "" {
		f, err := os.Create(*report)
		if err != nil {
			return err
		}
		defer f.Close()
		w = f
	}
	return res.writeReport(w)
}

// trap is one finding of the import: the LiteLLM setting, where it is,
// what it does there and what Sluice does instead.
type trap struct {
	setting string // "router_settings.num_retries"
	where   string // "model_list[1] (qwen-30b)", "" for global
	finding string
	sluice  string
}

type importResult struct {
	docs  []any
	traps []trap
}

func (r *importResult) add(setting, where, finding, sluice string) {
	r.traps = append(r.traps, trap{setting, where, finding, sluice})
}

func (r *importResult) writeReport(w io.Writer) error {
	fmt.Fprintf(w, "LiteLLM import: %d findings\n", len(r.traps))
	for _, t := range r.traps {
		where := ""
		if t.where != "" {
			where = " [" + t.where + "]"
		}
		fmt.Fprintf(w, "\n- %s%s\n    LiteLLM: %s\n    Sluice:  %s\n", t.setting, where, t.finding, t.sluice)
	}
	_, err := fmt.Fprintln(w)
	return err
}

// litellmRoutingDefects are the routing strategies with known defects on
// a homogeneous vLLM fleet.
var litellmRoutingDefects = map[string]string{
	"least-busy":             "counters in one non-atomic dictionary without TTL: increments are lost across replicas, a cancelled request excludes its replica forever",
	"latency-based-routing":  "measures seconds per output token, so short chat turns look slow and long agent outputs fast; new deployments start at zero latency and take all traffic",
	"usage-based-routing":    "minute windows reset all at once and tokens count at completion, so long generations in flight are invisible",
	"usage-based-routing-v2": "minute windows reset all at once and tokens count at completion, so long generations in flight are invisible",
	"cost-based-routing":     "takes the cheapest without a random tie-break: equal-priced replicas get all traffic on one; unpriced models cost 5.0 per token",
}

// importLiteLLM translates a LiteLLM config (and a team export) into
// apply documents and the trap report. Every setting it reads is either
// mapped or reported; settings it does not know are reported by name.
func importLiteLLM(cfgYAML, teamsJSON []byte, org string) (*importResult, error) {
	var cfg map[string]any
	if err := yaml.Unmarshal(cfgYAML, &cfg); err != nil {
		return nil, fmt.Errorf("config.yaml: %w", err)
	}
	if cfg == nil {
		return nil, errors.New("config.yaml is empty")
	}
	r := &importResult{}
	var groups []*modelGroupDoc
	byName := map[string]*modelGroupDoc{}
	list, _ := cfg["model_list"].([]any)
	for i, item := range list {
		m, ok := item.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("model_list[%d]: not a mapping", i)
		}
		name, _ := m["model_name"].(string)
		if name == "" {
			return nil, fmt.Errorf("model_list[%d]: model_name is required", i)
		}
		where := fmt.Sprintf("model_list[%d] (%s)", i, name)
		g := byName[name]
		if g == nil {
			// LiteLLM serves every model to every key: imported groups
			// are platform-wide (narrow them with grants afterwards).
			g = &modelGroupDoc{Kind: kindModelGroup, Name: name, PlatformWide: true}
			byName[name] = g
			groups = append(groups, g)
		}
		dep, err := importDeployment(r, m, where)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		g.Deployments = append(g.Deployments, dep)
		for _, k := range sortedKeys(m) {
			switch k {
			case "model_name", "litellm_params", "model_info":
			default:
				r.add("model_list[]."+k, where, "not mapped", "no equivalent: not imported")
			}
		}
	}
	aliases := importRouterSettings(r, cfg)
	orgLimits := importLiteLLMSettings(r, cfg)
	importGeneralSettings(r, cfg)
	for _, k := range sortedKeys(cfg) {
		switch k {
		case "model_list", "router_settings", "litellm_settings", "general_settings":
		default:
			r.add(k, "", "top-level section not mapped", "no equivalent: not imported")
		}
	}
	var teams []*teamDoc
	if len(teamsJSON) > 0 {
		var err error
		if teams, err = importTeams(r, teamsJSON, org); err != nil {
			return nil, err
		}
	}
	if len(aliases) > 0 {
		if len(teams) == 0 {
			r.add("router_settings.model_group_alias", "", "a proxy-wide alias map",
				"aliases live on teams and keys (model_group_aliases): none were imported here; give --teams, or set them with 'sluicectl team update --model-group-alias'")
		}
		for _, t := range teams {
			if t.ModelGroupAliases == nil {
				t.ModelGroupAliases = map[string]string{}
			}
			for k, v := range aliases {
				if _, ok := t.ModelGroupAliases[k]; !ok {
					t.ModelGroupAliases[k] = v
				}
			}
		}
	}
	for _, t := range teams {
		// LiteLLM's team models list the names clients ask for; Sluice's
		// allowed_models list model groups, checked after alias resolution.
		if t.Limits == nil {
			continue
		}
		for i, m := range t.Limits.AllowedModels {
			if g, ok := t.ModelGroupAliases[m]; ok {
				t.Limits.AllowedModels[i] = g
				r.add("team.models", "team "+t.Name, m+" is an alias name", "allowed_models lists model groups (checked after the alias resolves): imported as "+g)
			}
		}
	}
	if orgLimits != nil || len(teams) > 0 {
		r.docs = append(r.docs, &orgDoc{Kind: kindOrg, Name: org, Limits: orgLimits})
	}
	for _, g := range groups {
		r.docs = append(r.docs, g)
	}
	for _, t := range teams {
		r.docs = append(r.docs, t)
	}
	return r, nil
}

// importDeployment maps one model_list entry.
func importDeployment(r *importResult, m map[string]any, where string) (deploymentDoc, error) {
	var d deploymentDoc
	params, _ := m["litellm_params"].(map[string]any)
	info, _ := m["model_info"].(map[string]any)
	model, _ := params["model"].(string)
	if model == "" {
		return d, errors.New("litellm_params.model is required")
	}
	if i := strings.Index(model, "/"); i > 0 {
		// "hosted_vllm/Qwen3-30B": the provider prefix selects LiteLLM's
		// adapter; Sluice speaks OpenAI-compatible upstreams only.
		if p := model[:i]; p != "hosted_vllm" && p != "openai" && p != "vllm" {
			r.add("litellm_params.model", where, "provider "+p+" (LiteLLM adapter)", "Sluice forwards to OpenAI-compatible upstreams only: check that "+p+" offers an OpenAI-compatible endpoint at api_base")
		}
		model = model[i+1:]
	}
	d.UpstreamModel = model
	var inPrice, outPrice, cachedPrice float64
	var priced bool
	for _, k := range sortedKeys(params) {
		v := params[k]
		switch k {
		case "model":
		case "api_base":
			d.APIBase, _ = v.(string)
		case "api_key":
			s, _ := v.(string)
			if env, ok := strings.CutPrefix(s, "os.environ/"); ok {
				d.Credential = &credentialDoc{ValueFrom: &valueFrom{Env: env}}
			} else {
				r.add("litellm_params.api_key", where, "an inline secret", "not copied: the document reads the credential by reference; set credential.valueFrom.env (or file) on this deployment")
			}
		case "input_cost_per_token":
			inPrice, priced = number(v), true
		case "output_cost_per_token":
			outPrice, priced = number(v), true
		case "cache_read_input_token_cost":
			cachedPrice = number(v)
		case "tags":
			for _, t := range asList(v) {
				if t != "default" { // LiteLLM's default pool is Sluice's untagged deployments
					d.Tags = append(d.Tags, t)
				}
			}
		case "weight":
			d.Weight = int32(number(v))
		case "max_parallel_requests":
			d.MaxConcurrency = int64(number(v))
		case "tag_regex":
			r.add("litellm_params.tag_regex", where, "classifies by header regex "+show(v)+" (the header is client-controlled: classification, not access control)",
				"classification rules (a coming Sluice feature) — no equivalent yet: not imported; separate pools by credential with team model_group_aliases")
		case "rpm", "tpm":
			r.add("litellm_params."+k, where, "per-deployment "+k+" used for routing", "no per-deployment rate limit: cap concurrency with max_concurrency")
		case "timeout", "stream_timeout":
			r.add("litellm_params."+k, where, "per-attempt timeout", "one total deadline per request across attempts (sluice proxy --request-timeout)")
		case "priority":
			r.add("litellm_params.priority", where, "priority orders nothing while any deployment is healthy (its queue is read only when the whole group is in cooldown; priority 0 disables it on /chat/completions)", "traffic classes on teams and keys (traffic_class: interactive, agent, batch)")
		default:
			r.add("litellm_params."+k, where, "not mapped", "no equivalent: not imported")
		}
	}
	if d.APIBase == "" {
		return d, errors.New("litellm_params.api_base is required (Sluice forwards to an OpenAI-compatible base URL)")
	}
	if priced {
		d.Prices = &pricesDoc{InputPerToken: inPrice, OutputPerToken: outPrice, CachedInputPerToken: cachedPrice}
	} else {
		r.add("litellm_params.input_cost_per_token/output_cost_per_token", where, "unpriced: LiteLLM charges zero when the model is not in its price map (silent zero cost, budgets never run out)",
			"prices are required: apply refuses this deployment until you set prices (or free: true to declare it free)")
	}
	caps := &capabilitiesDoc{}
	maxIn := false
	for _, k := range sortedKeys(info) {
		v := info[k]
		switch k {
		case "max_input_tokens":
			caps.MaxInputTokens, maxIn = int64(number(v)), true
		case "max_output_tokens", "max_tokens":
			caps.MaxOutputTokens = int64(number(v))
		case "supports_function_calling":
			caps.Tools = v == true
		case "supports_response_schema":
			caps.JSONMode = v == true
		case "supports_vision":
			caps.Vision = v == true
		case "id":
			// Sluice identifies a deployment by api_base and upstream model.
		case "allow_fail_open":
			r.add("model_info.allow_fail_open", where, "tag routing falls through to the default pool only with this set", "untagged deployments always form the default pool")
		case "access_groups":
			r.add("model_info.access_groups", where, "permission groups", "allowed_models on orgs, teams, users and keys")
		default:
			r.add("model_info."+k, where, "not mapped", "no equivalent: not imported")
		}
	}
	if !maxIn {
		r.add("model_info.max_input_tokens", where, "missing: LiteLLM applies no context-window filter (fails silently for models not in its price map)",
			"capabilities.max_input_tokens filters oversized prompts (400 naming the parameter); set it — imported as 0, no filter")
	}
	if !isZero(caps) {
		d.Capabilities = caps
	}
	return d, nil
}

func isZero(c *capabilitiesDoc) bool { return *c == capabilitiesDoc{} }

// importRouterSettings reports router_settings and returns the global
// alias map.
func importRouterSettings(r *importResult, cfg map[string]any) map[string]string {
	rs, _ := cfg["router_settings"].(map[string]any)
	aliases := map[string]string{}
	for _, k := range sortedKeys(rs) {
		v := rs[k]
		set := "router_settings." + k
		switch k {
		case "routing_strategy":
			s, _ := v.(string)
			if defect, ok := litellmRoutingDefects[s]; ok {
				r.add(set, "", s+": "+defect, "routes by weighted shuffle over healthy deployments with fleet-wide concurrency caps; the strategy is not imported")
			} else if s != "simple-shuffle" {
				r.add(set, "", s+": not a strategy Sluice knows", "weighted shuffle (weight per deployment)")
			}
		case "model_group_alias":
			m, _ := v.(map[string]any)
			for a, g := range m {
				switch g := g.(type) {
				case string:
					aliases[a] = g
				case map[string]any:
					if s, ok := g["model"].(string); ok {
						aliases[a] = s
					}
				}
			}
			r.add(set, "", "proxy-wide aliases "+show(aliases), "model_group_aliases on the imported teams (aliases resolve per credential: key, then team)")
		case "num_retries":
			r.add(set, "", fmt.Sprintf("%v retries, each a full attempt (the retry product multiplies load on a saturated pool)", v),
				"sluice proxy --max-retries: retries only connect errors and 502/503/504 before the first byte, on another deployment, inside one deadline")
		case "retry_after", "cooldown_time", "allowed_fails", "allowed_fails_policy", "retry_policy":
			r.add(set, "", show(v), "no per-setting equivalent: Sluice ejects failing deployments itself and retries only before the first byte (sluice proxy --max-retries); not imported")
		case "timeout":
			r.add(set, "", "per-attempt timeout", "one total deadline per request (sluice proxy --request-timeout)")
		case "enable_tag_filtering", "tag_filtering_match_any":
			r.add(set, "", show(v), "tags on deployments are always honoured (untagged: default pool)")
		case "enable_pre_call_checks":
			r.add(set, "", "context-window checks only when enabled", "capabilities (max_input_tokens, tools, JSON mode, vision) are always checked")
		default:
			r.add(set, "", "not mapped", "no equivalent: not imported")
		}
	}
	return aliases
}

// importLiteLLMSettings maps litellm_settings; a proxy-wide budget
// becomes the org's limits.
func importLiteLLMSettings(r *importResult, cfg map[string]any) *limitsDoc {
	ls, _ := cfg["litellm_settings"].(map[string]any)
	var lim limitsDoc
	for _, k := range sortedKeys(ls) {
		v := ls[k]
		set := "litellm_settings." + k
		switch k {
		case "max_budget":
			f := number(v)
			lim.MaxBudget = &f
		case "budget_duration":
			lim.BudgetDuration = fmt.Sprint(v)
		case "request_timeout":
			r.add(set, "", fmt.Sprintf("%vs per attempt (with retries the caller may wait several times that)", v), "one total deadline across attempts, streaming included: sluice proxy --request-timeout")
		case "drop_params":
			if v == true {
				r.add(set, "", "silently drops parameters the upstream does not support", "requests needing a capability the group lacks are refused with 400 naming the parameter; nothing is dropped")
			}
		case "num_retries":
			r.add(set, "", fmt.Sprintf("%v retries", v), "sluice proxy --max-retries (before the first byte only)")
		case "cache":
			r.add(set, "", "response cache", "no response cache: not imported")
		default:
			r.add(set, "", "not mapped", "no equivalent: not imported")
		}
	}
	if lim.MaxBudget == nil && lim.BudgetDuration == "" {
		return nil
	}
	if lim.MaxBudget != nil && lim.BudgetDuration == "" {
		lim.BudgetDuration = "30d"
		r.add("litellm_settings.max_budget", "", "a budget without budget_duration never resets", "a budget needs a window: imported with budget_duration 30d, check it")
	}
	return &lim
}

func importGeneralSettings(r *importResult, cfg map[string]any) {
	gs, _ := cfg["general_settings"].(map[string]any)
	for _, k := range sortedKeys(gs) {
		v := gs[k]
		set := "general_settings." + k
		switch k {
		case "fail_closed_budget_enforcement":
			if v != true {
				r.add(set, "", "budgets fail open when Redis is unreachable (N replicas spend N budgets)", "budgets and concurrency always fail closed; rpm/tpm per level by limits.rate_limit_fallback")
			}
		case "apply_user_budget_to_team_keys":
			r.add(set, "", fmt.Sprintf("%v: a user's budget applies to team keys only when set", v), "a user's limits always apply to every key it uses, team keys included")
		case "store_audit_logs":
			r.add(set, "", fmt.Sprintf("%v: audit logging is optional", v), "every admin change writes a hash-chained audit row (sluicectl audit verify); always on")
		case "user_api_key_cache_ttl":
			r.add(set, "", fmt.Sprintf("keys cached %vs: a blocked key keeps working until the cache expires", v), "changes reach proxies as events in about a second; no cache TTL to set")
		case "max_parallel_requests", "global_max_parallel_requests":
			r.add(set, "", "read by no execution path (or only by the disabled legacy limiter)", "concurrency is enforced at every level (limits.max_parallel_requests) and per deployment (max_concurrency)")
		case "max_in_flight_requests_per_worker", "max_queued_requests_per_worker", "admission_queue_timeout_seconds":
			r.add(set, "", "per-worker admission, before authentication (rejections unattributed), read once", "no per-worker admission settings: deployment max_concurrency caps in-flight requests fleet-wide and limits reject attributed to the key; class-aware admission queues are a coming feature")
		case "master_key", "database_url":
			r.add(set, "", "secret or connection setting", "sluice control --admin-token / --database-url (environment or files): not imported")
		case "require_key_mcp_access_defined":
			r.add(set, "", "MCP access", "Sluice has no MCP gateway: not imported")
		default:
			r.add(set, "", "not mapped", "no equivalent: not imported")
		}
	}
}

// importTeams maps a LiteLLM team export (an array of team objects or one
// /team/info answer) to teams of org; fields it does not map are reported.
func importTeams(r *importResult, b []byte, org string) ([]*teamDoc, error) {
	var raw []map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		var one map[string]any
		if err2 := json.Unmarshal(b, &one); err2 != nil {
			return nil, fmt.Errorf("teams export: want a JSON array of team objects: %w", err)
		}
		if ti, ok := one["team_info"].(map[string]any); ok { // /team/info answer
			one = ti
		}
		raw = []map[string]any{one}
	}
	var out []*teamDoc
	for i, t := range raw {
		name, _ := t["team_alias"].(string)
		if name == "" {
			name, _ = t["team_id"].(string)
		}
		if name == "" {
			return nil, fmt.Errorf("teams export [%d]: no team_alias or team_id", i)
		}
		where := "team " + name
		d := &teamDoc{Kind: kindTeam, Org: org, Name: name}
		var lim limitsDoc
		for _, k := range sortedKeys(t) {
			v := t[k]
			switch k {
			case "team_alias", "team_id", "created_at", "updated_at", "spend", "organization_id", "members", "members_with_roles", "keys", "model_id", "budget_reset_at":
				// identity and bookkeeping
			case "max_budget":
				if v != nil {
					f := number(v)
					lim.MaxBudget = &f
				}
			case "budget_duration":
				if v != nil {
					lim.BudgetDuration = fmt.Sprint(v)
				}
			case "soft_budget":
				if v != nil {
					f := number(v)
					lim.SoftBudget = &f
				}
			case "rpm_limit", "tpm_limit":
				if v != nil {
					n := int64(number(v))
					if k == "rpm_limit" {
						lim.RpmLimit = &n
					} else {
						lim.TpmLimit = &n
					}
				}
			case "max_parallel_requests":
				if v != nil {
					n := int64(number(v))
					lim.MaxParallelRequests = &n
					r.add("team.max_parallel_requests", where, "stored and never enforced on teams", "enforced: team limits.max_parallel_requests caps the team's requests in flight")
				}
			case "models":
				for _, m := range asList(v) {
					if m != "all-proxy-models" {
						lim.AllowedModels = append(lim.AllowedModels, m)
					}
				}
			case "metadata":
				if m, ok := v.(map[string]any); ok {
					for _, mk := range sortedKeys(m) {
						mv := m[mk]
						if s, ok := mv.(string); ok {
							if d.Metadata == nil {
								d.Metadata = map[string]string{}
							}
							d.Metadata[mk] = s
						} else {
							r.add("team.metadata."+mk, where, "non-string metadata", "metadata values are strings: not imported")
						}
					}
				}
			case "router_settings":
				rs, _ := v.(map[string]any)
				for _, rk := range sortedKeys(rs) {
					rv := rs[rk]
					if rk == "model_group_alias" {
						if m, ok := rv.(map[string]any); ok {
							d.ModelGroupAliases = map[string]string{}
							for a, g := range m {
								d.ModelGroupAliases[a] = fmt.Sprint(g)
							}
						}
						continue
					}
					r.add("team.router_settings."+rk, where, "per-team router setting", "no per-team equivalent: not imported")
				}
			case "blocked":
				if v == true {
					r.add("team.blocked", where, "blocked team", "imported unblocked: block it with 'sluicectl team block' (apply does not set blocking)")
				}
			default:
				if v != nil {
					r.add("team."+k, where, "not mapped", "no equivalent: not imported")
				}
			}
		}
		if !isEmpty(lim.proto()) {
			d.Limits = &lim
		}
		out = append(out, d)
	}
	return out, nil
}

// importKeys reports each key of a LiteLLM key export with the command
// that creates its Sluice equivalent: keys are not apply documents (a
// token is shown once), and LiteLLM's tokens cannot be carried over. The
// key's token (or its hash) is never read into the report.
func (r *importResult) importKeys(b, teamsJSON []byte, org string) error {
	var raw []map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		var one map[string]any
		if err2 := json.Unmarshal(b, &one); err2 != nil {
			return fmt.Errorf("keys export: want a JSON array of key objects: %w", err)
		}
		if info, ok := one["info"].(map[string]any); ok { // /key/info answer
			one = info
		}
		raw = []map[string]any{one}
	}
	teamName := map[string]string{}
	var teams []map[string]any
	_ = json.Unmarshal(teamsJSON, &teams)
	for _, t := range teams {
		id, _ := t["team_id"].(string)
		if alias, _ := t["team_alias"].(string); alias != "" {
			teamName[id] = alias
		}
	}
	for i, k := range raw {
		alias, _ := k["key_alias"].(string)
		where := fmt.Sprintf("key %d", i)
		if alias != "" {
			where = "key " + alias
		}
		args := []string{"sluicectl key create", "--org " + org}
		if tid, _ := k["team_id"].(string); tid != "" {
			name := teamName[tid]
			if name == "" {
				name = tid
			}
			args = append(args, "--team <id of team "+name+">")
		}
		if alias != "" {
			args = append(args, "--alias "+alias)
		}
		for _, f := range []string{"max_budget", "budget_duration", "soft_budget", "rpm_limit", "tpm_limit", "max_parallel_requests"} {
			if v, ok := k[f]; ok && v != nil {
				args = append(args, "--"+strings.ReplaceAll(f, "_", "-")+" "+fmt.Sprint(v))
			}
		}
		aliases := map[string]any{}
		if rs, ok := k["router_settings"].(map[string]any); ok {
			aliases, _ = rs["model_group_alias"].(map[string]any)
		}
		if m := asList(k["models"]); len(m) > 0 && !(len(m) == 1 && m[0] == "all-proxy-models") {
			for i, name := range m {
				if g, ok := aliases[name]; ok { // allowed_models lists groups, checked after the alias resolves
					m[i] = fmt.Sprint(g)
				}
			}
			args = append(args, "--allowed-models "+strings.Join(m, ","))
		}
		for _, from := range sortedKeys(aliases) {
			args = append(args, "--model-group-alias "+from+"="+fmt.Sprint(aliases[from]))
		}
		if e, ok := k["expires"].(string); ok && e != "" {
			args = append(args, "--expires "+e)
		}
		r.add("key", where, "a virtual key (not imported: its token cannot be carried over)", strings.Join(args, " "))
		if v, ok := k["priority"]; ok && v != nil {
			r.add("key.priority", where, "priority orders nothing while any deployment is healthy", "traffic_class on the key or its team (--traffic-class)")
		}
		if k["blocked"] == true {
			r.add("key.blocked", where, "blocked key", "block the new key with 'sluicectl key block'")
		}
	}
	return nil
}

// show formats a setting's value for the report (JSON).
func show(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

func number(v any) float64 {
	switch n := v.(type) {
	case int:
		return float64(n)
	case int64:
		return float64(n)
	case float64:
		return n
	case string:
		f, _ := strconv.ParseFloat(n, 64)
		return f
	}
	return 0
}

func asList(v any) []string {
	var out []string
	switch l := v.(type) {
	case []any:
		for _, x := range l {
			out = append(out, fmt.Sprint(x))
		}
	case string:
		out = append(out, l)
	}
	sort.Strings(out)
	return out
}
