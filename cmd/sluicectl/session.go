package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// defaultContextName names the context login creates without --context.
const defaultContextName = "default"

func loginCommand() *command {
	return leaf("login", "--server URL --token TOKEN [--context NAME]",
		"verify an admin token and save it as a context (the current one)", runLogin)
}

func runLogin(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	server := fs.String("server", a.getenv("SLUICE_SERVER"), "admin API URL, e.g. https://sluice.example.com ($SLUICE_SERVER)")
	tok := fs.String("token", "", "admin token (default $SLUICE_TOKEN; prefer the variable: flags show in process listings)")
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	if *tok == "" {
		*tok = a.getenv("SLUICE_TOKEN")
	}
	switch {
	case *server == "":
		return errors.New("login: --server is required")
	case *tok == "":
		return errors.New("login: --token (or SLUICE_TOKEN) is required")
	}
	srv, err := normalizeServer(*server)
	if err != nil {
		return fmt.Errorf("login: %w", err)
	}
	name := a.contextName
	if name == "" {
		name = defaultContextName
	}
	if err := validContextName(name); err != nil {
		return fmt.Errorf("login: %w", err)
	}
	who, err := call(ctx, newClients(srv, *tok).tokens.WhoAmI, &adminv1.WhoAmIRequest{})
	if err != nil {
		return fmt.Errorf("login: token not accepted by %s: %w", srv, err)
	}
	path, err := configPath(a.getenv)
	if err != nil {
		return err
	}
	cfg, err := a.loadConfig(path)
	if err != nil {
		return err
	}
	cfg.upsert(configContext{Name: name, Server: srv, Token: *tok})
	cfg.CurrentContext = name
	if err := cfg.save(path); err != nil {
		return err
	}
	msg := fmt.Sprintf("Logged in to %s as %s; context %q saved in %s and now current.\n", srv, describe(who), name, path)
	if a.output != outTable { // keep stdout machine-readable
		fmt.Fprint(a.stderr, msg)
		return a.printer().message(who)
	}
	_, err = fmt.Fprint(a.stdout, msg)
	return err
}

// describe summarises a principal: "org-admin (token at_…, org admin of org_…)".
func describe(w *adminv1.WhoAmIResponse) string {
	s := fmt.Sprintf("%s (%s %s", w.GetName(), enumName(w.GetScope().Descriptor(), w.GetScope().Number()), enumName(w.GetRole().Descriptor(), w.GetRole().Number()))
	if w.GetOrgId() != "" {
		s += ", org " + w.GetOrgId()
	}
	if w.GetTeamId() != "" {
		s += ", team " + w.GetTeamId()
	}
	return s + ")"
}

func whoamiCommand() *command {
	return leaf("whoami", "", "show the token in use: principal, scope, org, team and role",
		func(ctx context.Context, a *app, c *cmdArgs) error {
			fs := a.flags(c)
			if _, err := a.parse(fs, c, 0, 0); err != nil {
				return err
			}
			t, err := a.resolve()
			if err != nil {
				return err
			}
			who, err := call(ctx, newClients(t.server, t.token).tokens.WhoAmI, &adminv1.WhoAmIRequest{})
			if err != nil {
				return err
			}
			extra := [][2]string{{"server", t.server}}
			if t.context != "" {
				extra = append(extra, [2]string{"context", t.context})
			}
			return a.printer().one(who, who, extra...)
		})
}

func contextCommand() *command {
	return group("context", "list, switch and delete saved contexts", []*command{
		leaf("list", "", "list saved contexts (tokens are not shown)", runContextList, "ls"),
		leaf("use", "NAME", "make NAME the current context", runContextUse),
		leaf("current", "", "print the current context's name", runContextCurrent),
		leaf("delete", "NAME", "delete a saved context and its token", runContextDelete, "rm"),
	}, "contexts")
}

func (a *app) configForEdit(c *cmdArgs, minArgs, maxArgs int) ([]string, *config, string, error) {
	fs := a.flags(c)
	pos, err := a.parse(fs, c, minArgs, maxArgs)
	if err != nil {
		return nil, nil, "", err
	}
	path, err := configPath(a.getenv)
	if err != nil {
		return nil, nil, "", err
	}
	cfg, err := a.loadConfig(path)
	return pos, cfg, path, err
}

func runContextList(_ context.Context, a *app, c *cmdArgs) error {
	_, cfg, _, err := a.configForEdit(c, 0, 0)
	if err != nil {
		return err
	}
	if a.output != outTable {
		type ctxOut struct {
			Name    string `json:"name"`
			Server  string `json:"server"`
			Current bool   `json:"current"`
		}
		out := []ctxOut{}
		for _, x := range cfg.Contexts {
			out = append(out, ctxOut{x.Name, x.Server, x.Name == cfg.CurrentContext})
		}
		return encodeJSONValue(a.printer(), out)
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CURRENT\tNAME\tSERVER")
	for _, x := range cfg.Contexts {
		cur := ""
		if x.Name == cfg.CurrentContext {
			cur = "*"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", cur, x.Name, x.Server)
	}
	return tw.Flush()
}

func runContextUse(_ context.Context, a *app, c *cmdArgs) error {
	pos, cfg, path, err := a.configForEdit(c, 1, 1)
	if err != nil {
		return err
	}
	if cfg.find(pos[0]) == nil {
		return fmt.Errorf("context %q is not in %s (contexts: %s)", pos[0], path, cfg.names())
	}
	cfg.CurrentContext = pos[0]
	if err := cfg.save(path); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "Switched to context %q.\n", pos[0])
	return nil
}

func runContextCurrent(_ context.Context, a *app, c *cmdArgs) error {
	_, cfg, path, err := a.configForEdit(c, 0, 0)
	if err != nil {
		return err
	}
	if cfg.CurrentContext == "" {
		return fmt.Errorf("no current context in %s: run 'sluicectl login' or 'sluicectl context use NAME'", path)
	}
	fmt.Fprintln(a.stdout, cfg.CurrentContext)
	return nil
}

func runContextDelete(_ context.Context, a *app, c *cmdArgs) error {
	pos, cfg, path, err := a.configForEdit(c, 1, 1)
	if err != nil {
		return err
	}
	if !cfg.remove(pos[0]) {
		return fmt.Errorf("context %q is not in %s (contexts: %s)", pos[0], path, cfg.names())
	}
	if err := cfg.save(path); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "Deleted context %q.\n", pos[0])
	return nil
}
