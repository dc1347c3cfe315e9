package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"google.golang.org/protobuf/types/known/structpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func explainCommand() *command {
	return leaf("explain", "", "explain what the proxy would decide for a request (ExplainService; docs/explain.md)", runExplain)
}

// headerFlag is a repeatable "Name: value" flag.
type headerFlag map[string]string

func (h headerFlag) String() string { return "" }

func (h headerFlag) Set(v string) error {
	name, val, ok := strings.Cut(v, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return fmt.Errorf("want \"Name: value\", got %q", v)
	}
	h[strings.TrimSpace(name)] = strings.TrimSpace(val)
	return nil
}

func runExplain(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	q := &configv1.ExplainQuery{Headers: map[string]string{}}
	region := fs.String("region", "", "the region whose data plane explains (default: the only region)")
	fs.StringVar(&q.KeyId, "key", "", "the key, by id (key_...)")
	tokenEnv := fs.String("token-env", "", "read the bearer credential (virtual key or signed JWT) from this environment variable")
	tokenFile := fs.String("token-file", "", "read the bearer credential from this file ('-': standard input)")
	issuer := fs.String("jwt-issuer", "", "explain JWT claims of this trusted issuer (iss)")
	audience := fs.String("jwt-audience", "", "the claims' audience (aud)")
	subject := fs.String("jwt-subject", "", "the claims' subject (sub)")
	claims := fs.String("jwt-claims", "", "the other claims as a JSON object, e.g. '{\"team\":\"platform\"}'")
	fs.StringVar(&q.Route, "route", "", "the proxy route (default /v1/chat/completions)")
	fs.StringVar(&q.Model, "model", "", "the requested model")
	fs.Var(headerFlag(q.Headers), "H", "a request header \"Name: value\" (repeatable)")
	fs.Var(headerFlag(q.Headers), "header", "same as -H")
	fs.BoolVar(&q.Stream, "stream", false, "a streaming request")
	fs.Int64Var(&q.MaxTokens, "max-tokens", 0, "max_tokens of the request")
	fs.Int64Var(&q.N, "n", 0, "n of the request")
	fs.BoolVar(&q.Tools, "tools", false, "the request carries tools")
	fs.Int64Var(&q.PromptBytes, "prompt-bytes", 0, "size of the prompt in bytes")
	body := fs.String("body", "", "a whole request body (JSON file, '-': standard input) instead of --model and the shape flags")
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	var err error
	switch {
	case *tokenEnv != "" && *tokenFile != "":
		return errors.New("explain: --token-env and --token-file are exclusive")
	case *tokenEnv != "":
		if q.Token = strings.TrimSpace(a.getenv(*tokenEnv)); q.Token == "" {
			return fmt.Errorf("explain: $%s is empty", *tokenEnv)
		}
	case *tokenFile != "":
		b, err := readInput(*tokenFile)
		if err != nil {
			return fmt.Errorf("explain: %w", err)
		}
		q.Token = strings.TrimSpace(string(b))
	}
	if *issuer != "" {
		j := &configv1.ExplainJWTClaims{Issuer: *issuer, Audience: *audience, Subject: *subject}
		if *claims != "" {
			var m map[string]any
			if err := json.Unmarshal([]byte(*claims), &m); err != nil {
				return fmt.Errorf("explain: --jwt-claims is not a JSON object: %w", err)
			}
			if j.Claims, err = structpb.NewStruct(m); err != nil {
				return fmt.Errorf("explain: --jwt-claims: %w", err)
			}
		}
		q.Jwt = j
	}
	if *body != "" {
		if q.Body, err = readInput(*body); err != nil {
			return fmt.Errorf("explain: %w", err)
		}
	}
	if q.KeyId == "" && q.Token == "" && q.Jwt == nil {
		return errors.New("explain: name the credential: --key KEY_ID, --token-env NAME, --token-file FILE or --jwt-issuer ISS")
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.explain.Explain, &adminv1.ExplainRequest{Region: *region, Query: q})
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	printTrace(a.stdout, r.GetTrace())
	return nil
}

func readInput(path string) ([]byte, error) {
	if path == "-" {
		return io.ReadAll(os.Stdin)
	}
	return os.ReadFile(path)
}

// printTrace writes a trace for people: the answer first, then each stage.
func printTrace(w io.Writer, tr *configv1.ExplainTrace) {
	o := tr.GetOutcome()
	if o.GetStatus() == 200 {
		fmt.Fprintf(w, "Answer:      200, forwarded to %s\n", strings.Join(tr.GetRouting().GetOrder()[:min(1, len(tr.GetRouting().GetOrder()))], ""))
	} else {
		fmt.Fprintf(w, "Answer:      %d %s at %s: %s\n", o.GetStatus(), o.GetErrorCode(), o.GetStage(), o.GetMessage())
	}
	fmt.Fprintf(w, "Explained by %s (region %s) at snapshot %d, region seq %d, route %s\n", tr.GetInstanceId(), tr.GetRegion(), tr.GetSnapshotVersion(), tr.GetRegionSeq(), tr.GetRoute())
	au := tr.GetAuth()
	state := "authenticated"
	if !au.GetAuthenticated() {
		state = "refused (" + au.GetErrorCode() + ")"
	}
	fmt.Fprintf(w, "Credential:  %s %s, %s; org %s team %s user %s\n", au.GetMethod(), cell(au.GetKeyId()), state, cell(au.GetOrgId()), cell(au.GetTeamId()), cell(au.GetUserId()))
	if cls := tr.GetTrafficClass(); cls != nil {
		fmt.Fprintf(w, "Class:       %s (%s) %s\n", cell(cls.GetClass()), cls.GetReason(), cls.GetDetail())
	}
	if m := tr.GetModel(); m != nil {
		alias := ""
		if m.GetAliasSource() != "" {
			alias = fmt.Sprintf(" (alias of the %s)", m.GetAliasSource())
		}
		fmt.Fprintf(w, "Model:       %s -> group %s%s\n", m.GetRequested(), m.GetGroup(), alias)
	}
	if len(tr.GetDeployments()) > 0 {
		fmt.Fprintf(w, "\nDeployments:\n")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "  ID\tUPSTREAM\tWEIGHT\tTAGS\tCANDIDATE\tPREFILL IN FLIGHT\tFILTERED BY\tWHY\n")
		for _, d := range tr.GetDeployments() {
			fmt.Fprintf(tw, "  %s\t%s\t%d\t%s\t%v\t%s\t%s\t%s\n", d.GetId(), d.GetUpstreamModel(), d.GetWeight(), cell(strings.Join(d.GetTags(), ",")), d.GetCandidate(),
				prefillCell(d), cell(d.GetFilteredBy()), cell(d.GetReason()))
		}
		_ = tw.Flush()
	}
	if len(tr.GetScopes()) > 0 {
		fmt.Fprintf(w, "\nLimits (estimate %d tokens, up to $%.6f):\n", tr.GetEstimatedTokens(), tr.GetMaxCostUsd())
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "  SCOPE\tRPM\tTPM\tPARALLEL\tBUDGET\tWOULD EXCEED\n")
		for _, s := range tr.GetScopes() {
			lim := func(used, limit int64) string {
				if limit == 0 {
					return "-"
				}
				if s.GetUnknown() {
					return fmt.Sprintf("?/%d", limit)
				}
				return fmt.Sprintf("%d/%d", used, limit)
			}
			bud := "-"
			if s.GetBudgetWindow() != "" {
				bud = fmt.Sprintf("$%.4f/$%.4f per %s (%s)", s.GetBudgetSpendUsd(), s.GetBudgetCapUsd(), s.GetBudgetWindow(), cell(s.GetBudgetState()))
			}
			fmt.Fprintf(tw, "  %s %s\t%s\t%s\t%s\t%s\t%s\n", s.GetKind(), s.GetId(), lim(s.GetRpmUsed(), s.GetRpmLimit()), lim(s.GetTpmUsed(), s.GetTpmLimit()),
				lim(s.GetParallelInUse(), s.GetParallelLimit()), bud, cell(s.GetWouldExceed()))
		}
		_ = tw.Flush()
	}
	if rt := tr.GetRouting(); rt != nil {
		fmt.Fprintf(w, "\nRouting:     %s", rt.GetReason())
		if rt.GetSession() != "" {
			fmt.Fprintf(w, " (session %s, pinned to %s)", rt.GetSession(), cell(rt.GetPinned()))
		}
		fmt.Fprintf(w, "; at most %d attempts\n", rt.GetMaxAttempts())
		for i, id := range rt.GetOrder() {
			role := "fallback"
			if i == 0 {
				role = "first"
			}
			fmt.Fprintf(w, "  %d. %s (%s)\n", i+1, id, role)
		}
	}
	for _, n := range tr.GetNotes() {
		fmt.Fprintf(w, "Note: %s\n", n)
	}
}

// prefillCell is a deployment's fleet-wide prefill tokens in flight over its
// max_prefill_tokens_in_flight ("-": no cap; "?": no fleet-wide count), and
// "skipped: prefill cap" when the cap would skip it for this request.
func prefillCell(d *configv1.ExplainDeployment) string {
	if d.PrefillTokensInFlight == nil && d.GetMaxPrefillTokensInFlight() == 0 {
		return "-"
	}
	inFlight, capTokens := "?", "-"
	if d.PrefillTokensInFlight != nil {
		inFlight = fmt.Sprint(d.GetPrefillTokensInFlight())
	}
	if c := d.GetMaxPrefillTokensInFlight(); c > 0 {
		capTokens = fmt.Sprint(c)
	}
	out := inFlight + "/" + capTokens
	if d.GetPrefillCapped() {
		out += fmt.Sprintf(" (+%d: skipped, prefill cap)", d.GetPrefillEstimate())
	}
	return out
}
