/* The pod sandbox's process: holds the pod's namespaces, reaps orphans, exits on
 * SIGINT/SIGTERM. Built statically here because no registry is reachable. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_exit_signal(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction exit_action = {.sa_handler = on_exit_signal};
  struct sigaction child_action = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &exit_action, NULL) || sigaction(SIGTERM, &exit_action, NULL) ||
      sigaction(SIGCHLD, &child_action, NULL))
    return 1;
  for (;;) pause();
}
